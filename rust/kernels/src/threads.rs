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
