//! The attention op on CUDA devices: `kernels/attention.cu`, compiled by `build.rs`, launched
//! on candle's stream through a [`CustomOp3`].
//!
//! The host cuts the batch into work items ([`plan::Plan`]) once per step; every layer reuses
//! the plan on the device (it depends on the batch and the shapes, not on the layer). The same
//! planner and the same launches run under the emulator ([`emulator`], feature
//! `cuda-emulator`), which is how the kernel is checked on machines without a GPU.

#[cfg(feature = "cuda-emulator")]
pub mod emulator;
pub(crate) mod plan;

#[cfg(feature = "cuda")]
pub(super) use launch::{CudaAttention, PlanCache};

#[cfg(feature = "cuda")]
mod launch;
