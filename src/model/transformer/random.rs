//! Seeded random weights of a configuration's shape, under Hugging Face names: for tests
//! against other implementations and for throughput studies of shapes whose weights are not at
//! hand.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::names::{Role, Scheme};
use super::{Transformer, WeightFormat};
use crate::model::arch::Architecture;
use crate::model::config::ModelConfig;
use crate::{Error, Result};

impl Transformer {
    /// A model of `config`'s shape with random weights, for throughput studies of shapes whose
    /// weights are not at hand (the papers measure 7B-70B shapes): [`Self::random_tensors`]
    /// loaded as a checkpoint. The same `seed` gives the same weights.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for an inconsistent `config`.
    pub fn random(
        config: ModelConfig,
        seed: u64,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let tensors = Self::random_tensors(&config, seed, device)?;
        Self::from_hf_tensors(config, tensors, format, device)
    }

    /// Seeded random weights of `config`'s shape under their Hugging Face names, as a
    /// checkpoint of its architecture holds them (Gemma's norms as offsets from one): for
    /// tests against other implementations and for throughput studies. Values are uniform,
    /// scaled by each matrix's fan-in so activations keep their size through the layers; the
    /// norms every architecture has are one, the others vary around one, biases around zero.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for an inconsistent `config`.
    pub fn random_tensors(
        config: &ModelConfig,
        seed: u64,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>> {
        let mut tensors = Self::random_unfused(config, seed, device)?;
        if config.architecture == Architecture::GptOss {
            super::gpt_oss::fuse(config, &mut tensors)?;
        }
        Ok(tensors)
    }

    /// [`Self::random_tensors`] with every expert's projections apart, as the graph names them.
    pub(super) fn random_unfused(
        config: &ModelConfig,
        seed: u64,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>> {
        config.validate()?;
        let c = config;
        let (h, q, kv, ff) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        let mut state = seed;
        let matrix = |state: &mut u64, rows: usize, cols: usize| -> Result<Tensor> {
            let bound = (3.0 / cols as f32).sqrt();
            // The state advances by a constant per value, so chunks start from their own
            // offsets in parallel and give the serial sequence's values (an 8B shape's
            // billions of them in seconds).
            const CHUNK: usize = 1 << 16;
            let start = *state;
            let mut values = vec![0f32; rows * cols];
            values
                .par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, chunk)| {
                    let mut s = start.wrapping_add(((c * CHUNK) as u64).wrapping_mul(GAMMA));
                    for v in chunk {
                        *v = (2.0 * splitmix_unit(&mut s) - 1.0) * bound;
                    }
                });
            *state = start.wrapping_add(((rows * cols) as u64).wrapping_mul(GAMMA));
            Ok(Tensor::from_vec(values, (rows, cols), device)?)
        };
        let arch = c.architecture;
        let offset: f32 = if arch.hf_norm_offset() { 1.0 } else { 0.0 };
        // The norms every architecture has are one, as before the others existed, so seeds
        // keep their weights.
        let vector = |state: &mut u64, n: usize, around: f32| -> Result<Tensor> {
            let values: Vec<f32> = (0..n)
                .map(|_| around + (splitmix_unit(state) - 0.5) * 0.2)
                .collect();
            Ok(Tensor::from_vec(values, n, device)?)
        };
        let ones = |n: usize| {
            (Tensor::ones(n, DType::F32, device)? - f64::from(offset)).map_err(Error::from)
        };
        let g = Scheme::Hf.globals();
        let mut tensors = HashMap::new();
        tensors.insert(g.embed.to_string(), matrix(&mut state, c.vocab_size, h)?);
        if !c.tie_word_embeddings {
            tensors.insert(g.output.to_string(), matrix(&mut state, c.vocab_size, h)?);
        }
        tensors.insert(g.norm.to_string(), ones(h)?);
        let roles = Role::of(c);
        let ffe = c.experts.map_or(0, |e| e.intermediate_size);
        for i in 0..c.num_layers {
            for &role in &roles {
                let t = match role {
                    Role::Wq => matrix(&mut state, q, h)?,
                    Role::Wk | Role::Wv => matrix(&mut state, kv, h)?,
                    Role::Wo => matrix(&mut state, h, q)?,
                    Role::Gate | Role::Up => matrix(&mut state, ff, h)?,
                    Role::Down => matrix(&mut state, h, ff)?,
                    Role::Wqkv => matrix(&mut state, q + 2 * kv, h)?,
                    Role::GateUp => matrix(&mut state, 2 * ff, h)?,
                    Role::Router => matrix(&mut state, c.experts.map_or(0, |e| e.count), h)?,
                    Role::ExpertGate(_) | Role::ExpertUp(_) => matrix(&mut state, ffe, h)?,
                    Role::ExpertDown(_) => matrix(&mut state, h, ffe)?,
                    Role::AttnNorm | Role::FfnNorm => ones(h)?,
                    Role::PostAttnNorm | Role::PostFfnNorm => vector(&mut state, h, 1.0 - offset)?,
                    Role::QNorm | Role::KNorm => vector(&mut state, c.head_dim, 1.0 - offset)?,
                    Role::QBias => vector(&mut state, q, 0.0)?,
                    Role::KBias | Role::VBias => vector(&mut state, kv, 0.0)?,
                    Role::OBias | Role::ExpertDownBias(_) => vector(&mut state, h, 0.0)?,
                    Role::RouterBias => vector(&mut state, c.experts.map_or(0, |e| e.count), 0.0)?,
                    Role::ExpertGateBias(_) | Role::ExpertUpBias(_) => {
                        vector(&mut state, ffe, 0.0)?
                    }
                    Role::Sinks => vector(&mut state, c.num_heads, 0.0)?,
                };
                tensors.insert(role.name(Scheme::Hf, arch, i), t);
            }
        }
        Ok(tensors)
    }
}

/// splitmix64's increment of the state per value.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64: a uniform value in [0, 1) from a 64-bit state, fast enough for a billion
/// weights and stable across platforms and crate versions (unlike a `rand` generator).
fn splitmix_unit(state: &mut u64) -> f32 {
    *state = state.wrapping_add(GAMMA);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 24) as f32
}
