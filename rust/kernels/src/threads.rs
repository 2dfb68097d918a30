//! The rayon pool the kernels run on. Its size follows the caller (torch's thread count, or a
//! setting); a pool is built once per size and kept, so a call costs no thread start.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

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

/// Run `f` on every item: on a pool of `num_threads` workers when that is more than one and
/// there is more than one item (or no pool could be built: on the calling thread).
pub fn for_each_item<T: Sync>(num_threads: usize, items: &[T], f: impl Fn(&T) + Sync + Send) {
    use rayon::prelude::*;
    let pool = if num_threads > 1 && items.len() > 1 {
        pool(num_threads)
    } else {
        None
    };
    match pool {
        Some(pool) => pool.install(|| items.par_iter().for_each(&f)),
        None => items.iter().for_each(f),
    }
}
