//! specinfer's scheduling core: request state, the paged-KV block pool with prefix
//! caching, the token-budget scheduler (continuous batching, chunked prefill,
//! speculative lookahead, preemption by recompute), batch packing into flat arrays,
//! the n-gram (prompt lookup) proposer and suffix decoding's tries. Pure Rust; `rust/bindings` exposes it
//! to Python as `specinfer._core` (see `docs/core_api.md`).

pub mod batch;
pub mod block_pool;
pub mod config;
pub mod error;
mod hash;
mod invariants;
pub mod kv_cache_manager;
pub mod lookahead;
pub mod ngram;
pub mod padding;
pub mod request;
pub mod scheduler;
pub mod suffix;
pub mod tree;
pub mod update;

pub use batch::{ScheduledRun, SchedulerOutput};
pub use block_pool::{BlockHash, BlockId, BlockPool, DEAD_BLOCK};
pub use config::SchedulerConfig;
pub use error::{CoreError, Result};
pub use lookahead::{AHEAD_INPUT, PLACEHOLDER_TOKEN};
pub use padding::TokenPadding;
pub use request::{FinishReason, Request, RequestId, RequestStatus, StopParams};
pub use scheduler::{Scheduler, SchedulerStats};
pub use tree::MAX_TREE_NODES;
pub use update::UpdateOutput;
