//! The attention op on CUDA devices: `kernels/attention.cu`, compiled to PTX by `build.rs`,
//! launched on candle's stream through a [`CustomOp3`].
//!
//! The host cuts the batch into work items as the CPU kernel does (sequence, block of query
//! rows, kv head, segment of context tiles) and lists them for the kernel ([`Plan`]); each item
//! is one thread block writing a partial softmax state, and a second kernel merges each
//! output group's segments in context order. The plan is plain data, built and tested without
//! a GPU.

#[cfg(feature = "cuda")]
use candle_core::{CpuStorage, CustomOp3, Layout, Shape};

use super::{AttentionBatch, Dims};

/// Queries per item (`MAX_Q` in the kernel): rows per item are `MAX_Q / group`.
const MAX_Q: usize = 32;
/// Context entries per segment: a long context is split over items (the split-context
/// variant), merged at the end.
const SEGMENT_ENTRIES: usize = 512;
/// Ints per item: seq, row0, row1, g, tile0, tile1 (`ITEM_INTS` in the kernel).
const ITEM_INTS: usize = 6;

/// Context entries per tile for a head dimension (`k_tile` in the kernel).
fn k_tile(head_dim: usize) -> usize {
    if head_dim <= 64 {
        64
    } else {
        32
    }
}

/// The kernel's work list for one batch.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// `ITEM_INTS` ints per item, the segments of one output group consecutive and in order.
    pub items: Vec<i32>,
    /// Per output group (a sequence's row block and kv head): first item and item count.
    pub groups: Vec<i32>,
}

impl Plan {
    /// Items of at most [`MAX_Q`] queries and [`SEGMENT_ENTRIES`] context entries.
    pub(super) fn new(batch: &AttentionBatch, dims: Dims) -> Self {
        let group = (dims.n_heads / dims.n_kv_heads.max(1)).max(1);
        let rows_per_item = (MAX_Q / group).max(1);
        let tile = k_tile(dims.head_dim);
        let tiles_per_segment = SEGMENT_ENTRIES / tile;
        let (mut items, mut groups) = (Vec::new(), Vec::new());
        for (seq, view) in batch.sequences().enumerate() {
            let rows = view.q_positions.len();
            let tiles = view.ctx_slots.len().div_ceil(tile).max(1);
            for row0 in (0..rows).step_by(rows_per_item) {
                let row1 = (row0 + rows_per_item).min(rows);
                for g in 0..dims.n_kv_heads {
                    let first = items.len() / ITEM_INTS;
                    for t0 in (0..tiles).step_by(tiles_per_segment) {
                        let t1 = (t0 + tiles_per_segment).min(tiles);
                        items.extend([seq, row0, row1, g, t0, t1].map(|x| x as i32));
                    }
                    groups.extend([first as i32, (items.len() / ITEM_INTS - first) as i32]);
                }
            }
        }
        Self { items, groups }
    }

    #[cfg(feature = "cuda")]
    fn num_items(&self) -> usize {
        self.items.len() / ITEM_INTS
    }
}

/// The op as candle sees it on a CUDA device.
#[cfg(feature = "cuda")]
pub(super) struct CudaAttention<'a> {
    pub batch: &'a AttentionBatch,
    pub dims: Dims,
    pub scale: f32,
}

#[cfg(feature = "cuda")]
impl CustomOp3 for CudaAttention<'_> {
    fn name(&self) -> &'static str {
        "pensieve-paged-attention-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CUDA attention op runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        launch::forward(self, (q, q_l), (k, k_l), (v, v_l))
    }
}

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, Layout, Shape};

    use super::{CudaAttention, Plan, MAX_Q};

    /// The kernels, as `build.rs` compiled them.
    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
    const MODULE: &str = "pensieve_attention";

    type Operand<'a> = (&'a CudaStorage, &'a Layout);

    /// The batch and the plan on the device, and the partials the kernels pass on.
    struct Buffers {
        q_offsets: CudaSlice<i32>,
        ctx_offsets: CudaSlice<i32>,
        q_positions: CudaSlice<u32>,
        ctx_slots: CudaSlice<u32>,
        ctx_positions: CudaSlice<u32>,
        items: CudaSlice<i32>,
        groups: CudaSlice<i32>,
        part_acc: CudaSlice<f32>,
        part_ml: CudaSlice<f32>,
    }

    impl Buffers {
        fn new(op: &CudaAttention<'_>, plan: &Plan, dev: &CudaDevice) -> candle_core::Result<Self> {
            let b = op.batch;
            let offsets = |o: &[usize]| o.iter().map(|&x| x as i32).collect::<Vec<i32>>();
            let partials = plan.num_items() * MAX_Q;
            Ok(Self {
                q_offsets: dev.clone_htod(&offsets(&b.q_offsets))?,
                ctx_offsets: dev.clone_htod(&offsets(&b.ctx_offsets))?,
                q_positions: dev.clone_htod(&b.q_positions)?,
                ctx_slots: dev.clone_htod(&b.ctx_slots)?,
                ctx_positions: dev.clone_htod(&b.ctx_positions)?,
                items: dev.clone_htod(&plan.items)?,
                groups: dev.clone_htod(&plan.groups)?,
                // SAFETY (both): every partial a merge reads is written first by its item's
                // block, earlier on the same stream.
                part_acc: unsafe { dev.alloc::<f32>(partials * op.dims.head_dim)? },
                part_ml: unsafe { dev.alloc::<f32>(partials * 2)? },
            })
        }
    }

    /// The contiguous part of `s` that `l` covers.
    fn view<'a, T: DeviceRepr>(
        s: &'a CudaSlice<T>,
        l: &Layout,
        what: &str,
    ) -> candle_core::Result<CudaView<'a, T>> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(s.slice(a..b)),
            None => candle_core::bail!("{what} must be contiguous for the CUDA attention kernel"),
        }
    }

    pub(super) fn forward(
        op: &CudaAttention<'_>,
        (q, q_l): Operand<'_>,
        (k, k_l): Operand<'_>,
        (v, v_l): Operand<'_>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev: &CudaDevice = &q.device;
        let d = op.dims;
        let CudaStorageSlice::F32(q_s) = &q.slice else {
            candle_core::bail!("q must be f32 for the CUDA attention kernel")
        };
        if d.head_dim != 64 && d.head_dim != 128 {
            candle_core::bail!(
                "the CUDA attention kernel takes head dim 64 or 128, not {}",
                d.head_dim
            )
        }
        let out = dev.alloc_zeros::<f32>(d.tokens * d.n_heads * d.head_dim)?;
        let plan = Plan::new(op.batch, d);
        if plan.num_items() > 0 {
            let bufs = Buffers::new(op, &plan, dev)?;
            let q = view(q_s, q_l, "q")?;
            let func = |dtype: &str| {
                let name = format!("pensieve_attention_{dtype}_d{}", d.head_dim);
                let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
                Ok::<_, candle_core::Error>(func.into_cuda_function())
            };
            match (&k.slice, &v.slice) {
                (CudaStorageSlice::F32(ks), CudaStorageSlice::F32(vs)) => {
                    attend(dev, &func("f32")?, op, &q, (ks, k_l), (vs, v_l), &bufs)?
                }
                (CudaStorageSlice::F16(ks), CudaStorageSlice::F16(vs)) => {
                    attend(dev, &func("f16")?, op, &q, (ks, k_l), (vs, v_l), &bufs)?
                }
                (CudaStorageSlice::BF16(ks), CudaStorageSlice::BF16(vs)) => {
                    attend(dev, &func("bf16")?, op, &q, (ks, k_l), (vs, v_l), &bufs)?
                }
                _ => {
                    candle_core::bail!("the CUDA attention kernel reads two f32, f16 or bf16 pools")
                }
            }
            merge(dev, op, &bufs, &out)?;
        }
        let shape = Shape::from((d.tokens, d.n_heads, d.head_dim));
        let storage = CudaStorage {
            slice: CudaStorageSlice::F32(out),
            device: dev.clone(),
        };
        Ok((storage, shape))
    }

    /// One block of 128 threads per item: the partials.
    fn attend<T: DeviceRepr>(
        dev: &CudaDevice,
        func: &CudaFunction,
        op: &CudaAttention<'_>,
        q: &CudaView<'_, f32>,
        (k, k_l): (&CudaSlice<T>, &Layout),
        (v, v_l): (&CudaSlice<T>, &Layout),
        bufs: &Buffers,
    ) -> candle_core::Result<()> {
        let (k, v) = (view(k, k_l, "k")?, view(v, v_l, "v")?);
        let (heads, kv_heads) = (op.dims.n_heads as i32, op.dims.n_kv_heads as i32);
        let items = bufs.items.len() / super::ITEM_INTS;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(func);
        b.arg(q);
        b.arg(&k);
        b.arg(&v);
        b.arg(&bufs.q_offsets);
        b.arg(&bufs.ctx_offsets);
        b.arg(&bufs.q_positions);
        b.arg(&bufs.ctx_slots);
        b.arg(&bufs.ctx_positions);
        b.arg(&bufs.items);
        b.arg(&bufs.part_acc);
        b.arg(&bufs.part_ml);
        b.arg(&heads);
        b.arg(&kv_heads);
        b.arg(&op.scale);
        let cfg = blocks(items, 128);
        // SAFETY: the arguments match the attention kernels' parameters in order and type;
        // every index the kernel forms comes from the plan and the batch, whose slots
        // `Dims::check` checked against the pool.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// A 1-D grid of `n` blocks of `threads` threads, static shared memory only.
    fn blocks(n: usize, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// One block per output group: the segments folded in order, normalized, into `out`.
    fn merge(
        dev: &CudaDevice,
        op: &CudaAttention<'_>,
        bufs: &Buffers,
        out: &CudaSlice<f32>,
    ) -> candle_core::Result<()> {
        let func = dev.get_or_load_custom_func("pensieve_attention_merge", MODULE, PTX)?;
        let d = op.dims;
        let (heads, kv_heads, head_dim) =
            (d.n_heads as i32, d.n_kv_heads as i32, d.head_dim as i32);
        let groups = bufs.groups.len() / 2;
        let mut b = func.builder();
        b.arg(&bufs.part_acc);
        b.arg(&bufs.part_ml);
        b.arg(&bufs.items);
        b.arg(&bufs.groups);
        b.arg(&bufs.q_offsets);
        b.arg(out);
        b.arg(&heads);
        b.arg(&kv_heads);
        b.arg(&head_dim);
        let cfg = blocks(groups, 256);
        // SAFETY: the arguments match `pensieve_attention_merge`'s parameters in order and
        // type; the partials were written by `attend` on the same stream.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Plan, ITEM_INTS, MAX_Q, SEGMENT_ENTRIES};
    use crate::attention::{AttentionBatch, Dims};

    fn dims(tokens: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Dims {
        Dims {
            tokens,
            n_heads,
            n_kv_heads,
            head_dim,
            n_slots: 1 << 20,
        }
    }

    /// Every (query row, query head) appears in exactly one output group, every context tile
    /// of its sequence in exactly one of that group's items, in order; items stay within the
    /// kernel's query limit.
    #[test]
    fn the_plan_covers_every_query_and_tile_once() -> crate::Result<()> {
        let mut batch = AttentionBatch::new();
        let ctx: Vec<u32> = (0..1300).collect();
        batch.push_sequence(&[1299], &ctx, &ctx)?; // a long decode row: 3 segments
        let rows: Vec<u32> = (0..50).collect();
        batch.push_sequence(&rows, &ctx[..50], &ctx[..50])?; // a prefill run
        for (heads, kv_heads, head_dim) in [(9, 3, 64), (32, 8, 128), (4, 4, 64)] {
            let d = dims(51, heads, kv_heads, head_dim);
            let plan = Plan::new(&batch, d);
            let group = heads / kv_heads;
            let tile = if head_dim <= 64 { 64 } else { 32 };
            let mut seen = vec![0; 51 * kv_heads];
            for g in plan.groups.chunks_exact(2) {
                let (first, count) = (g[0] as usize, g[1] as usize);
                let item = |i: usize| &plan.items[(first + i) * ITEM_INTS..][..ITEM_INTS];
                let (seq, row0, row1, kvh) = (item(0)[0], item(0)[1], item(0)[2], item(0)[3]);
                assert!(((row1 - row0) as usize) * group <= MAX_Q);
                let mut next_tile = 0;
                for i in 0..count {
                    let it = item(i);
                    assert_eq!(&it[..4], &[seq, row0, row1, kvh]);
                    assert_eq!(it[4], next_tile);
                    assert!(((it[5] - it[4]) as usize) * tile <= SEGMENT_ENTRIES);
                    next_tile = it[5];
                }
                let ctx_len = if seq == 0 { 1300 } else { 50 };
                assert_eq!(next_tile as usize, (ctx_len as usize).div_ceil(tile));
                let first_row = if seq == 0 { 0 } else { 1 };
                for r in row0..row1 {
                    seen[(first_row + r as usize) * kv_heads + kvh as usize] += 1;
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "{seen:?}");
        }
        Ok(())
    }
}
