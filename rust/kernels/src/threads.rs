//! The threads the kernels run on. Their number follows the caller (torch's thread count, or a
//! setting). Item-parallel kernels (`for_each_item`) run on a *team*: the calling thread and
//! `num_threads - 1` helpers that spin for a short while after each call before they park, so
//! the back-to-back calls of a forward (a decode makes ~150 of a few to a few hundred µs each)
//! hand work over in well under a µs instead of the tens of µs a sleeping rayon worker takes to
//! wake (measured: a SmolLM2 decode's attention calls took 4x longer on 2 rayon threads than on
//! one). Each thread of a call starts on its own contiguous share of the items, claimed from a
//! cursor on a cache line of its own, then takes what is left of the others' shares: a thread's
//! weight rows stream in order and the claims do not bounce one line between cores (a SmolLM2
//! decode's 120 GEMMs on 2 threads: 11-12 % faster than all threads claiming from one counter,
//! interleaved A/B). Row-parallel helpers (`pool`) keep a rayon pool; both are built once per
//! size and kept.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::{ThreadPool, ThreadPoolBuilder};

static POOLS: OnceLock<Mutex<HashMap<usize, Arc<ThreadPool>>>> = OnceLock::new();

/// A pool of exactly `num_threads` (>= 2) workers; None when it cannot be built.
pub fn pool(num_threads: usize) -> Option<Arc<ThreadPool>> {
    let pools = POOLS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut pools = pools.lock().ok()?;
    if let Some(p) = pools.get(&num_threads) {
        return Some(p.clone());
    }
    let p = Arc::new(
        ThreadPoolBuilder::new()
            .num_threads(num_threads)
            .thread_name(|i| format!("specinfer-attn-{i}"))
            .build()
            .ok()?,
    );
    pools.insert(num_threads, p.clone());
    Some(p)
}

/// Run `f` on every item: on a team of `num_threads` (the caller and `num_threads - 1` helpers)
/// when that is more than one and there is more than one item; on the calling thread when not,
/// or when the team is busy with another caller's call (a nested or concurrent call).
pub fn for_each_item<T: Sync>(num_threads: usize, items: &[T], f: impl Fn(&T) + Sync + Send) {
    if num_threads > 1 && items.len() > 1 {
        if let Some(team) = team(num_threads) {
            let run = |i: usize| f(&items[i]);
            if team.run(items.len(), &run) {
                return;
            }
        }
    }
    items.iter().for_each(f)
}

/// A pointer into an output that the items of one call write at disjoint places, shareable
/// between the team's threads.
#[derive(Clone, Copy)]
pub(crate) struct DisjointOut<T>(pub(crate) *mut T);
// SAFETY: the items of a call write disjoint elements, and the call outlives them.
unsafe impl<T> Send for DisjointOut<T> {}
unsafe impl<T> Sync for DisjointOut<T> {}

impl<T> DisjointOut<T> {
    /// Element `i` (a method, so closures capture the Sync wrapper, not its raw pointer field).
    ///
    /// # Safety
    /// `i` is within the output.
    #[inline(always)]
    pub(crate) unsafe fn at(self, i: usize) -> *mut T {
        self.0.add(i)
    }
}

/// How long an idle helper spins before it parks (a forward's calls come within µs of each
/// other; between steps it sleeps).
const SPIN: Duration = Duration::from_micros(60);

type Job = *const (dyn Fn(usize) + Sync);

/// A value alone on its cache lines (a thread claiming items from its own cursor does not
/// contend with the others for the line).
#[repr(align(128))]
struct Line<T>(T);

struct Shared {
    epoch: AtomicUsize, // bumped by each call; helpers wait for it to change
    job: UnsafeCell<Option<(Job, usize)>>, // the call's item function and item count
    // thread t's next item: the team's threads each start on a contiguous share of the items
    // (so a thread's weight rows stream in order), then take what is left of the others'
    cursors: Vec<Line<AtomicUsize>>,
    pending: AtomicUsize,  // helpers still inside the current call
    sleepers: AtomicUsize, // helpers parked (or about to be)
    panicked: AtomicBool,  // an item panicked on a helper
}

impl Shared {
    /// Items of an `n`-item call for thread `t`: its own share first, then the others' rest.
    fn work(&self, t: usize, n: usize, job: &(dyn Fn(usize) + Sync)) {
        let threads = self.cursors.len();
        for u in (t..threads).chain(0..t) {
            let end = (u + 1) * n / threads;
            loop {
                let i = self.cursors[u].0.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    break;
                }
                job(i);
            }
        }
    }
}

// SAFETY: `job` is written by the one caller holding `Team::busy` before it publishes the epoch
// (release) and read by helpers after they observe it (acquire); the caller does not return (or
// write it again) until every helper has left the call (`pending` back to 0).
unsafe impl Sync for Shared {}
// SAFETY: the raw job pointer is only dereferenced under the protocol above.
unsafe impl Send for Shared {}

pub struct Team {
    shared: Arc<Shared>,
    helpers: Vec<std::thread::Thread>,
    busy: Mutex<()>,
}

static TEAMS: OnceLock<Mutex<HashMap<(u32, usize), Arc<Team>>>> = OnceLock::new();

/// The team of `num_threads` (>= 2) of this process (a forked child builds its own); None when
/// its helpers cannot be started.
fn team(num_threads: usize) -> Option<Arc<Team>> {
    let key = (std::process::id(), num_threads);
    let teams = TEAMS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut teams = teams.lock().ok()?;
    if let Some(t) = teams.get(&key) {
        return Some(t.clone());
    }
    let shared = Arc::new(Shared {
        epoch: AtomicUsize::new(0),
        job: UnsafeCell::new(None),
        cursors: (0..num_threads)
            .map(|_| Line(AtomicUsize::new(0)))
            .collect(),
        pending: AtomicUsize::new(0),
        sleepers: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    });
    let mut helpers = Vec::with_capacity(num_threads - 1);
    for i in 0..num_threads - 1 {
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("specinfer-team-{i}"))
            .spawn(move || helper(&sh, i + 1))
            .ok()?;
        helpers.push(handle.thread().clone());
    }
    let t = Arc::new(Team {
        shared,
        helpers,
        busy: Mutex::new(()),
    });
    teams.insert(key, t.clone());
    Some(t)
}

fn helper(sh: &Shared, t: usize) {
    let mut seen = 0;
    loop {
        let mut since: Option<Instant> = None;
        let mut spins = 0u32;
        loop {
            let e = sh.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins % 256 != 0 {
                std::hint::spin_loop();
                continue;
            }
            let start = *since.get_or_insert_with(Instant::now);
            if start.elapsed() < SPIN {
                continue;
            }
            // park; the caller unparks every helper after publishing a call while any sleeps
            sh.sleepers.fetch_add(1, Ordering::SeqCst);
            if sh.epoch.load(Ordering::SeqCst) == seen {
                std::thread::park();
            }
            sh.sleepers.fetch_sub(1, Ordering::SeqCst);
            since = None;
        }
        // SAFETY: published before the epoch this helper observed; valid until `pending` is 0.
        let (job, n) = unsafe { (*sh.job.get()).expect("a call publishes its job") };
        let job: &(dyn Fn(usize) + Sync) = unsafe { &*job };
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sh.work(t, n, job)));
        if ok.is_err() {
            sh.panicked.store(true, Ordering::Relaxed);
        }
        sh.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Team {
    /// Run `f(0) .. f(n - 1)` over the caller and the helpers; false (nothing ran) when the team
    /// is busy with another call. Panics if an item panicked.
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        let Ok(_busy) = self.busy.try_lock() else {
            return false;
        };
        let sh = &*self.shared;
        // SAFETY: the lifetime is erased only while this call runs: it returns after every
        // helper has left the job (pending == 0).
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        unsafe { *sh.job.get() = Some((job, n)) };
        let threads = sh.cursors.len();
        for (t, c) in sh.cursors.iter().enumerate() {
            c.0.store(t * n / threads, Ordering::Relaxed);
        }
        sh.panicked.store(false, Ordering::Relaxed);
        sh.pending.store(self.helpers.len(), Ordering::Relaxed);
        sh.epoch.fetch_add(1, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            self.helpers.iter().for_each(|h| h.unpark());
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sh.work(0, n, f)));
        let mut spins = 0u32;
        while sh.pending.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                std::thread::yield_now(); // a helper preempted by the OS: let it run
            } else {
                std::hint::spin_loop();
            }
        }
        unsafe { *sh.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        assert!(
            !sh.panicked.load(Ordering::Relaxed),
            "a kernel item panicked on a helper thread"
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_item_runs_once_for_every_size_and_team() {
        for threads in [1, 2, 3, 4] {
            for n in [0, 1, 2, 3, 7, 64, 1000] {
                let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
                let items: Vec<usize> = (0..n).collect();
                for_each_item(threads, &items, |&i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "threads {threads} n {n}"
                );
            }
        }
    }

    #[test]
    fn helpers_take_items_and_calls_after_a_park_still_run() {
        let items: Vec<usize> = (0..64).collect();
        let who = Mutex::new(std::collections::HashSet::new());
        for round in 0..3 {
            if round == 2 {
                std::thread::sleep(SPIN * 20); // helpers park in between
            }
            // a team size no other test uses (a busy team runs a call on its caller alone)
            for_each_item(5, &items, |_| {
                who.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(Duration::from_micros(200));
            });
        }
        assert!(
            who.lock().unwrap().len() >= 2,
            "the helper never took an item"
        );
    }

    #[test]
    fn concurrent_and_nested_calls_fall_back_to_the_caller() {
        let total = AtomicU64::new(0);
        let items: Vec<u64> = (1..=100).collect();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        for_each_item(2, &items, |&x| {
                            // a nested call: the team is busy with this one, so it runs here
                            for_each_item(2, &[x], |&y| {
                                total.fetch_add(y, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 5050);
    }

    #[test]
    fn a_panicking_item_panics_the_call_and_the_team_goes_on() {
        let items: Vec<usize> = (0..32).collect();
        let r =
            std::panic::catch_unwind(|| for_each_item(2, &items, |&i| assert!(i != 17, "item 17")));
        assert!(r.is_err());
        let count = AtomicU64::new(0);
        for_each_item(2, &items, |_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 32);
    }
}
