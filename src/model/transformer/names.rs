//! The tensors a configuration's graph reads, by name in each checkpoint format, and the check
//! that a file holds exactly those: run on the file's index before any weight is read, so a
//! missing tensor or one the graph would ignore (a Qwen2 bias under a `llama` config, say) is
//! refused instead of loading into wrong text.

use std::collections::BTreeSet;

use crate::model::arch::Architecture;
use crate::model::config::ModelConfig;
use crate::{Error, Result};

/// A checkpoint's naming scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scheme {
    /// llama.cpp's GGUF names (`blk.N.attn_q.weight`).
    Gguf,
    /// Hugging Face names (`model.layers.N.self_attn.q_proj.weight`).
    Hf,
}

/// What a tensor of a decoder layer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    AttnNorm,
    Wq,
    Wk,
    Wv,
    Wo,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    PostAttnNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
    PostFfnNorm,
    /// Q, K and V in one matrix (rows in that order).
    Wqkv,
    /// The MLP's gate and up in one matrix (the gate's rows first).
    GateUp,
    /// A mixture's router (one score per expert).
    Router,
    /// Expert `e`'s gate, up and down projections.
    ExpertGate(usize),
    ExpertUp(usize),
    ExpertDown(usize),
    /// gpt-oss's biases of the attention output, the router and each expert's projections,
    /// and its attention sinks (one score per query head).
    OBias,
    RouterBias,
    ExpertGateBias(usize),
    ExpertUpBias(usize),
    ExpertDownBias(usize),
    Sinks,
}

impl Role {
    /// The roles a layer of `config`'s graph has, in load order.
    pub(super) fn of(config: &ModelConfig) -> Vec<Role> {
        use Role::*;
        let arch = config.architecture;
        let fused = arch.fused_projections();
        // In the order random weights are drawn in: a seed keeps its weights.
        let mut roles = match fused {
            true => vec![AttnNorm, Wqkv, Wo, FfnNorm],
            false => vec![AttnNorm, Wq, Wk, Wv, Wo, FfnNorm],
        };
        match config.experts {
            Some(experts) => {
                roles.push(Router);
                for e in 0..experts.count {
                    roles.extend([ExpertGate(e), ExpertUp(e), ExpertDown(e)]);
                }
            }
            None if fused => roles.extend([GateUp, Down]),
            None => roles.extend([Gate, Up, Down]),
        }
        if arch.qkv_bias() {
            roles.extend([QBias, KBias, VBias]);
        }
        if arch.qk_norm() {
            roles.extend([QNorm, KNorm]);
        }
        if arch.post_norms() {
            roles.extend([PostAttnNorm, PostFfnNorm]);
        }
        if arch.sinks_and_biases() {
            roles.extend([OBias, Sinks, RouterBias]);
            for e in 0..config.experts.map_or(0, |x| x.count) {
                roles.extend([ExpertGateBias(e), ExpertUpBias(e), ExpertDownBias(e)]);
            }
        }
        roles
    }

    /// The part of its tensor a role's matrix or vector is in `scheme`: an expert's of a
    /// GGUF file's stacked experts (one tensor per projection, each expert's matrix or bias
    /// after another), else the whole tensor.
    pub(super) fn part(self, scheme: Scheme) -> Part {
        use Role::*;
        match (scheme, self) {
            (
                Scheme::Gguf,
                ExpertGate(e) | ExpertUp(e) | ExpertDown(e) | ExpertGateBias(e) | ExpertUpBias(e)
                | ExpertDownBias(e),
            ) => Part::Expert(e),
            _ => Part::Whole,
        }
    }

    /// Whether the tensor is a norm weight (a vector the activations are scaled by).
    pub(super) fn is_norm(self) -> bool {
        use Role::*;
        matches!(
            self,
            AttnNorm | QNorm | KNorm | PostAttnNorm | FfnNorm | PostFfnNorm
        )
    }

    /// Whether the tensor is a bias (a vector added to a projection).
    pub(super) fn is_bias(self) -> bool {
        use Role::*;
        matches!(
            self,
            QBias
                | KBias
                | VBias
                | OBias
                | RouterBias
                | ExpertGateBias(_)
                | ExpertUpBias(_)
                | ExpertDownBias(_)
        )
    }

    /// Whether the tensor is a vector the graph reads as it is (a norm, a bias, the sinks).
    pub(super) fn is_vector(self) -> bool {
        self.is_norm() || self.is_bias() || self == Role::Sinks
    }

    /// The tensor's name in layer `layer` of a checkpoint in `scheme` of `arch`.
    pub(super) fn name(self, scheme: Scheme, arch: Architecture, layer: usize) -> String {
        use Role::*;
        let gemma = arch == Architecture::Gemma3;
        // Hugging Face's Mixtral names its mixture and its experts' projections otherwise.
        let (moe, [gate, up, down]) = match arch {
            Architecture::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        let expert = |e: usize, hf: &str, gguf: &str, kind: &str| match scheme {
            // GGUF files stack a layer's experts in one tensor per projection (gpt-oss's
            // Hugging Face checkpoints too: `super::gpt_oss` reads each expert's apart).
            Scheme::Gguf => format!("blk.{layer}.{gguf}.{kind}"),
            Scheme::Hf => format!("model.layers.{layer}.{moe}.experts.{e}.{hf}.{kind}"),
        };
        // gpt-oss names its router `router`.
        let router = match arch {
            Architecture::GptOss => "router",
            _ => "gate",
        };
        let (gguf, hf) = match self {
            ExpertGate(e) => return expert(e, gate, "ffn_gate_exps", "weight"),
            ExpertUp(e) => return expert(e, up, "ffn_up_exps", "weight"),
            ExpertDown(e) => return expert(e, down, "ffn_down_exps", "weight"),
            ExpertGateBias(e) => return expert(e, gate, "ffn_gate_exps", "bias"),
            ExpertUpBias(e) => return expert(e, up, "ffn_up_exps", "bias"),
            ExpertDownBias(e) => return expert(e, down, "ffn_down_exps", "bias"),
            Router | RouterBias => {
                let kind = if self == Router { "weight" } else { "bias" };
                return match scheme {
                    Scheme::Gguf => format!("blk.{layer}.ffn_gate_inp.{kind}"),
                    Scheme::Hf => format!("model.layers.{layer}.{moe}.{router}.{kind}"),
                };
            }
            OBias => ("attn_output.bias", "self_attn.o_proj.bias"),
            Sinks => ("attn_sinks.weight", "self_attn.sinks"),
            AttnNorm => ("attn_norm.weight", "input_layernorm.weight"),
            Wq => ("attn_q.weight", "self_attn.q_proj.weight"),
            Wk => ("attn_k.weight", "self_attn.k_proj.weight"),
            Wv => ("attn_v.weight", "self_attn.v_proj.weight"),
            Wo => ("attn_output.weight", "self_attn.o_proj.weight"),
            Wqkv => ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
            GateUp => ("ffn_up.weight", "mlp.gate_up_proj.weight"),
            QBias => ("attn_q.bias", "self_attn.q_proj.bias"),
            KBias => ("attn_k.bias", "self_attn.k_proj.bias"),
            VBias => ("attn_v.bias", "self_attn.v_proj.bias"),
            QNorm => ("attn_q_norm.weight", "self_attn.q_norm.weight"),
            KNorm => ("attn_k_norm.weight", "self_attn.k_norm.weight"),
            // Hugging Face's Gemma names its norm after attention what Llama names the norm
            // before the MLP.
            PostAttnNorm => (
                "post_attention_norm.weight",
                "post_attention_layernorm.weight",
            ),
            FfnNorm if gemma => ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
            // llama.cpp names gpt-oss's norm before the mixture after attention.
            FfnNorm if arch == Architecture::GptOss => (
                "post_attention_norm.weight",
                "post_attention_layernorm.weight",
            ),
            FfnNorm => ("ffn_norm.weight", "post_attention_layernorm.weight"),
            Gate => ("ffn_gate.weight", "mlp.gate_proj.weight"),
            Up => ("ffn_up.weight", "mlp.up_proj.weight"),
            Down => ("ffn_down.weight", "mlp.down_proj.weight"),
            PostFfnNorm => ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
        };
        match scheme {
            Scheme::Gguf => format!("blk.{layer}.{gguf}"),
            Scheme::Hf => format!("model.layers.{layer}.{hf}"),
        }
    }
}

/// The part of a tensor a linear layer's weights are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    Whole,
    /// Matrix `e` of a `[experts, rows, columns]` tensor.
    Expert(usize),
    /// `len` rows from `start` of a matrix (one projection of a fused one).
    Rows {
        start: usize,
        len: usize,
    },
}

/// Names of the tensors outside the layers.
pub(super) struct Globals {
    pub embed: &'static str,
    pub norm: &'static str,
    pub output: &'static str,
}

impl Scheme {
    pub(super) fn globals(self) -> Globals {
        match self {
            Scheme::Gguf => Globals {
                embed: "token_embd.weight",
                norm: "output_norm.weight",
                output: "output.weight",
            },
            Scheme::Hf => Globals {
                embed: "model.embed_tokens.weight",
                norm: "model.norm.weight",
                output: "lm_head.weight",
            },
        }
    }

    /// Tensors a file may hold that the graph reads outside this table (Llama 3 GGUFs' RoPE
    /// frequency factors, Phi-3's LongRoPE factors) or that hold nothing of the model (old
    /// checkpoints' cached RoPE frequencies).
    fn ignorable(self, name: &str) -> bool {
        match self {
            Scheme::Gguf => matches!(
                name,
                "rope_freqs.weight" | "rope_factors_short.weight" | "rope_factors_long.weight"
            ),
            Scheme::Hf => name.ends_with(".rotary_emb.inv_freq"),
        }
    }
}

/// Checks that `present` (a file's tensor names) holds every tensor `config`'s graph reads
/// and nothing else.
///
/// # Errors
/// [`Error::InvalidModel`] naming the first missing tensor, or the tensors the graph would not
/// use.
pub(super) fn check_tensors<'a>(
    config: &ModelConfig,
    scheme: Scheme,
    present: impl IntoIterator<Item = &'a str>,
) -> Result<()> {
    let present: BTreeSet<&str> = present.into_iter().collect();
    let g = scheme.globals();
    let mut wanted = BTreeSet::from([g.embed.to_string(), g.norm.to_string()]);
    if !config.tie_word_embeddings {
        wanted.insert(g.output.to_string());
    }
    let roles = Role::of(config);
    for layer in 0..config.num_layers {
        wanted.extend(
            roles
                .iter()
                .map(|r| r.name(scheme, config.architecture, layer)),
        );
    }
    if let Some(missing) = wanted.iter().find(|n| !present.contains(n.as_str())) {
        return Err(Error::invalid_model(
            missing.as_str(),
            format!("missing tensor (a {} model needs it)", config.architecture),
        ));
    }
    let unused: Vec<&str> = present
        .iter()
        .copied()
        .filter(|n| !wanted.contains(*n) && !scheme.ignorable(n))
        .collect();
    if !unused.is_empty() {
        let shown: Vec<&str> = unused.iter().copied().take(4).collect();
        return Err(Error::invalid_model(
            shown[0],
            format!(
                "{} tensor(s) a {} graph would not use ({}{}): the file is another \
                 architecture or variant, and ignoring them would give wrong text",
                unused.len(),
                config.architecture,
                shown.join(", "),
                if unused.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            ),
        ));
    }
    Ok(())
}
