//! gpt-oss's Hugging Face checkpoints hold a layer's experts in four tensors:
//! `mlp.experts.gate_up_proj` (`[experts, hidden, 2 * inner]`: input-major, each expert's
//! gate and up outputs interleaved, gate first), its bias `gate_up_proj_bias`
//! (`[experts, 2 * inner]`), `down_proj` (`[experts, inner, hidden]`) and `down_proj_bias`.
//! The graph reads each expert's projections apart, under the names a checkpoint that held
//! them apart would give them (`mlp.experts.E.gate_proj.weight`, ...): loading reads the four
//! tensors once per layer and cuts each expert's matrices out of them; seeded random weights
//! are drawn apart and fused into the checkpoint's layout.
//!
//! OpenAI's own checkpoints hold the experts' matrices in MXFP4 instead: `gate_up_proj_blocks`
//! (`[experts, 2 * inner, hidden / 32, 16]`: output-major, gate and up rows interleaved, 32
//! E2M1 values per 16 bytes, value `2j` in byte `j`'s low nibble) and `gate_up_proj_scales`
//! (`[experts, 2 * inner, hidden / 32]`: an E8M0 exponent per 32 values), and `down_proj_*`
//! alike. Each expert's matrix is cut out of them as rows of GGUF's MXFP4 blocks (a `u8`
//! tensor), which the packed format keeps in their codes.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::model::config::ModelConfig;
use crate::{Error, Result};

/// An expert projection's weight or bias, as the graph names it.
struct Named {
    layer: usize,
    expert: usize,
    proj: Proj,
    bias: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Proj {
    Gate,
    Up,
    Down,
}

impl Named {
    /// Parses `model.layers.L.mlp.experts.E.{gate,up,down}_proj.{weight,bias}`.
    fn parse(name: &str) -> Option<Self> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once(".mlp.experts.")?;
        let (expert, rest) = rest.split_once('.')?;
        let (proj, kind) = rest.split_once('.')?;
        let proj = match proj {
            "gate_proj" => Proj::Gate,
            "up_proj" => Proj::Up,
            "down_proj" => Proj::Down,
            _ => return None,
        };
        Some(Self {
            layer: layer.parse().ok()?,
            expert: expert.parse().ok()?,
            proj,
            bias: match kind {
                "weight" => false,
                "bias" => true,
                _ => return None,
            },
        })
    }

    /// The checkpoint's tensor holding it (`suffix`: `_blocks` or `_scales` for an MXFP4
    /// checkpoint's matrices).
    fn fused(&self, suffix: &str) -> String {
        let base = match self.proj {
            Proj::Gate | Proj::Up => "gate_up_proj",
            Proj::Down => "down_proj",
        };
        let bias = if self.bias { "_bias" } else { suffix };
        format!("model.layers.{}.mlp.experts.{base}{bias}", self.layer)
    }

    /// Its matrix out of MXFP4 `blocks` and `scales`, as `[rows, blocks · 17]` bytes of GGUF's
    /// MXFP4 blocks (the exponent, then value `j` and `j + 16` in byte `j`'s nibbles).
    fn cut_mxfp4(&self, blocks: &Tensor, scales: &Tensor) -> Result<Tensor> {
        let bad = |why: String| Error::invalid_model(self.fused("_blocks"), why);
        let (b, s) = (blocks.get(self.expert)?, scales.get(self.expert)?);
        let (n, per_row, bytes) = b.dims3()?;
        if bytes != 16 || s.dims() != [n, per_row] || b.dtype() != DType::U8 {
            return Err(bad(format!("{:?} with scales {:?}", b.dims(), s.dims())));
        }
        let (b, s) = match self.proj {
            Proj::Down => (b, s),
            Proj::Gate | Proj::Up => (self.pick(&b, 0)?, self.pick(&s, 0)?),
        };
        let rows = b.dim(0)?;
        let (b, s) = (
            b.flatten_all()?.to_vec1::<u8>()?,
            s.flatten_all()?.to_vec1::<u8>()?,
        );
        let mut out = Vec::with_capacity(rows * per_row * 17);
        for (block, &e) in b.chunks_exact(16).zip(&s) {
            let value = |i: usize| block[i / 2] >> (4 * (i % 2)) & 0x0F;
            out.push(e);
            out.extend((0..16).map(|j| value(j) | value(j + 16) << 4));
        }
        Ok(Tensor::from_vec(
            out,
            (rows, per_row * 17),
            blocks.device(),
        )?)
    }

    /// Gate or up's half of `t`, whose dimension `dim` interleaves them: even ones the gate's,
    /// odd the up's.
    fn pick(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let offset = usize::from(self.proj == Proj::Up);
        let dims = t.dims();
        let mut shape = dims[..dim].to_vec();
        shape.extend([dims[dim] / 2, 2]);
        shape.extend(&dims[dim + 1..]);
        Ok(t.reshape(shape)?
            .narrow(dim + 1, offset, 1)?
            .squeeze(dim + 1)?)
    }

    /// Its part of the fused tensor `t`.
    fn cut(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.get(self.expert)?;
        // Gate and up are interleaved along the outputs.
        Ok(match (self.proj, self.bias) {
            (Proj::Down, true) => t,
            (Proj::Down, false) => t.t()?.contiguous()?,
            (_, true) => self.pick(&t, 0)?.contiguous()?,
            (_, false) => self.pick(&t, 1)?.t()?.contiguous()?,
        })
    }
}

/// The names of a checkpoint's tensors with each layer's fused expert tensors replaced by the
/// names of every expert's projections (an MXFP4 matrix's `_blocks` and `_scales` by its
/// projections once).
pub(super) fn unfused_names(config: &ModelConfig, names: &[String]) -> Vec<String> {
    let experts = config.experts.map_or(0, |e| e.count);
    let mut out = Vec::with_capacity(names.len() + 6 * experts * config.num_layers);
    for name in names {
        let Some((layer, tensor)) = fused_tensor(name) else {
            out.push(name.clone());
            continue;
        };
        let (projs, kind): (&[&str], _) = match tensor {
            "gate_up_proj" | "gate_up_proj_blocks" => (&["gate_proj", "up_proj"], "weight"),
            "gate_up_proj_bias" => (&["gate_proj", "up_proj"], "bias"),
            "down_proj" | "down_proj_blocks" => (&["down_proj"], "weight"),
            "down_proj_bias" => (&["down_proj"], "bias"),
            _ => continue,
        };
        for e in 0..experts {
            for p in projs {
                out.push(format!("model.layers.{layer}.mlp.experts.{e}.{p}.{kind}"));
            }
        }
    }
    out
}

/// The layer and kind of a fused expert tensor's name.
fn fused_tensor(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, tensor) = rest.split_once(".mlp.experts.")?;
    let base = (tensor.strip_suffix("_blocks"))
        .or_else(|| tensor.strip_suffix("_scales"))
        .or_else(|| tensor.strip_suffix("_bias"))
        .unwrap_or(tensor);
    matches!(base, "gate_up_proj" | "down_proj").then_some((layer, tensor))
}

/// Reads each expert's projections out of the fused tensors, each read once while its layer
/// loads.
pub(super) struct Unfuse {
    cache: HashMap<String, Tensor>,
    /// The matrices are MXFP4 (`_blocks` and `_scales`).
    mxfp4: bool,
}

impl Unfuse {
    /// A reader of the checkpoint whose tensors are `names`.
    pub(super) fn new(names: &[String]) -> Self {
        Self {
            cache: HashMap::new(),
            mxfp4: names.iter().any(|n| n.ends_with("_blocks")),
        }
    }

    /// The tensor `name` as the graph names it: cut from its fused tensor (read through
    /// `fetch`), or `fetch`ed as it is.
    pub(super) fn fetch(
        &mut self,
        name: &str,
        fetch: &mut impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let Some(named) = Named::parse(name) else {
            return fetch(name);
        };
        // Another layer's tensors are done with.
        let layer = format!("model.layers.{}.", named.layer);
        self.cache.retain(|k, _| k.starts_with(&layer));
        let mut held = |name: String| -> Result<Tensor> {
            if let Some(t) = self.cache.get(&name) {
                return Ok(t.clone());
            }
            let t = fetch(&name)?;
            self.cache.insert(name, t.clone());
            Ok(t)
        };
        match self.mxfp4 && !named.bias {
            true => named.cut_mxfp4(
                &held(named.fused("_blocks"))?,
                &held(named.fused("_scales"))?,
            ),
            false => named.cut(&held(named.fused(""))?),
        }
    }
}

/// Fuses seeded random experts drawn apart (under the graph's names) into the checkpoint's
/// layout, as [`Unfuse`] reads it.
pub(super) fn fuse(config: &ModelConfig, tensors: &mut HashMap<String, Tensor>) -> Result<()> {
    let experts = config.experts.map_or(0, |e| e.count);
    for layer in 0..config.num_layers {
        let mut take = |e: usize, proj: &str, kind: &str| {
            let name = format!("model.layers.{layer}.mlp.experts.{e}.{proj}.{kind}");
            tensors
                .remove(&name)
                .ok_or_else(|| Error::invalid_model(name, "missing tensor"))
        };
        let (mut gate_up, mut gate_up_bias, mut down, mut down_bias) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for e in 0..experts {
            // `[inner, hidden]` each: interleaved along the outputs, input-major.
            let (g, u) = (
                take(e, "gate_proj", "weight")?,
                take(e, "up_proj", "weight")?,
            );
            let (inner, hidden) = g.dims2()?;
            let gu = Tensor::stack(&[g.t()?, u.t()?], 2)?.reshape((hidden, 2 * inner))?;
            gate_up.push(gu);
            let (gb, ub) = (take(e, "gate_proj", "bias")?, take(e, "up_proj", "bias")?);
            gate_up_bias.push(Tensor::stack(&[gb, ub], 1)?.reshape(2 * inner)?);
            down.push(take(e, "down_proj", "weight")?.t()?.contiguous()?);
            down_bias.push(take(e, "down_proj", "bias")?);
        }
        for (tensor, parts) in [
            ("gate_up_proj", gate_up),
            ("gate_up_proj_bias", gate_up_bias),
            ("down_proj", down),
            ("down_proj_bias", down_bias),
        ] {
            let name = format!("model.layers.{layer}.mlp.experts.{tensor}");
            tensors.insert(name, Tensor::stack(&parts, 0)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn fused_experts_cut_back_into_the_projections_they_were_made_of() -> Result<()> {
        let json = r#"{"architectures":["GptOssForCausalLM"],"vocab_size":32,"hidden_size":8,
            "intermediate_size":6,"num_hidden_layers":1,"num_attention_heads":2,
            "num_key_value_heads":1,"head_dim":4,"num_local_experts":3,
            "num_experts_per_tok":2,"attention_bias":true}"#;
        let config = ModelConfig::from_hf_json(json)?;
        let apart = crate::model::Transformer::random_unfused(&config, 5, &Device::Cpu)?;
        let mut fused = apart.clone();
        fuse(&config, &mut fused)?;
        let names: Vec<String> = fused.keys().cloned().collect();
        let mut unfused = unfused_names(&config, &names);
        let mut expected: Vec<String> = apart.keys().cloned().collect();
        unfused.sort();
        expected.sort();
        assert_eq!(unfused, expected);
        let mut unfuse = Unfuse::new(&names);
        let mut fetch = |n: &str| -> Result<Tensor> {
            (fused.get(n).cloned()).ok_or_else(|| Error::invalid_model(n, "missing"))
        };
        for (name, t) in &apart {
            let cut = unfuse.fetch(name, &mut fetch)?;
            let same = (cut.sub(t)?.abs()?.sum_all()?.to_scalar::<f32>()?) == 0.0;
            assert!(same && cut.dims() == t.dims(), "{name}");
        }
        Ok(())
    }
}
