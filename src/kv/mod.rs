//! KV storage and bookkeeping. This part: the device pool of slots that attention
//! reads. Knows the model only by its layer count and KV shape.

mod pool;

pub use pool::KvPool;
