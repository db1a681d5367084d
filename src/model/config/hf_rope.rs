//! A `config.json`'s rotary embedding in either form transformers writes: 4.x's top-level
//! `rope_theta` and `rope_scaling`, or 5.x's `rope_parameters` (base and scaling in one object;
//! per layer type for Gemma 3, whose local layers turn on their own base). Both read to one
//! [`HfRope`], so a checkpoint loads to the same model whichever version saved it. A key this
//! graph does not implement is refused by name, never dropped: a dropped scaling loads a model
//! that answers, wrongly.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::yarn::Yarn;
use super::Llama3RopeScaling;
use crate::{Error, Result};

/// LongRoPE's short factors, long factors and attention factor.
pub(super) type LongRope = (Vec<f32>, Vec<f32>, Option<f32>);

/// The `config.json` fields that describe the rotary embedding, in both forms.
#[derive(Deserialize)]
pub(super) struct RopeFields {
    rope_theta: Option<f32>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    rope_local_base_freq: Option<f32>,
    partial_rotary_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

/// A scaling other than `default`: its type and the parameters it names.
#[derive(Debug, PartialEq)]
struct Scaling {
    kind: String,
    params: Map<String, Value>,
}

/// One entry of the rotary embedding: a base, maybe a scaling, maybe a partial rotation.
#[derive(Debug, Default, PartialEq)]
struct Entry {
    theta: Option<f32>,
    scaling: Option<Scaling>,
    partial: Option<f64>,
}

/// The rotary embedding a `config.json` declares, whichever form it is written in.
#[derive(Debug)]
pub(super) struct HfRope {
    global: Entry,
    /// The base of the sliding-window layers, where the config gives one.
    local_theta: Option<f32>,
    /// The window the model was trained with, from the top level (4.x's Phi-3 and YaRN).
    original: Option<usize>,
}

fn invalid(field: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid_model(format!("config.json {field}"), why)
}

/// Reads one rotary entry (`field` names it in errors): `rope_theta`, `partial_rotary_factor`
/// and the type (`rope_type`, or `type` as older Phi-3 configs spell it) taken out, the rest
/// the scaling's parameters.
fn entry(field: &str, value: &Value) -> Result<Entry> {
    let Value::Object(object) = value else {
        return Err(invalid(field, "must be an object"));
    };
    let mut params = object.clone();
    let number = |v: Option<Value>, key: &str| {
        v.filter(|v| !v.is_null())
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| invalid(&format!("{field}.{key}"), "must be a number"))
            })
            .transpose()
    };
    let theta = number(params.remove("rope_theta"), "rope_theta")?.map(|t| t as f32);
    let partial = number(
        params.remove("partial_rotary_factor"),
        "partial_rotary_factor",
    )?;
    let named = |key: &str, v: Option<Value>| match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(&format!("{field}.{key}"), "must be a string")),
    };
    let kind = match (
        named("rope_type", params.remove("rope_type"))?,
        named("type", params.remove("type"))?,
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                field,
                format!("rope_type '{a}' and type '{b}' differ"),
            ));
        }
        (Some(k), _) | (None, Some(k)) => k,
        (None, None) => "default".to_owned(),
    };
    let allowed: &[&str] = match kind.as_str() {
        "default" => &[],
        "linear" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "longrope" | "su" => &[
            "short_factor",
            "long_factor",
            "attention_factor",
            "original_max_position_embeddings",
        ],
        // `Yarn` refuses another key by name.
        "yarn" => &[],
        other => {
            return Err(invalid(
                field,
                format!(
                    "rope_type '{other}' is not supported (supported: default, llama3, linear, \
                     longrope, yarn)"
                ),
            ));
        }
    };
    if kind != "yarn"
        && let Some(key) = params.keys().find(|k| !allowed.contains(&k.as_str()))
    {
        return Err(invalid(
            &format!("{field}.{key}"),
            format!("is not supported with rope_type '{kind}'"),
        ));
    }
    let scaling = (kind != "default").then_some(Scaling { kind, params });
    Ok(Entry {
        theta,
        scaling,
        partial,
    })
}

impl RopeFields {
    /// The rotary embedding, with `gemma` telling whether per-layer-type parameters are the
    /// architecture's (Gemma 3's local layers).
    ///
    /// # Errors
    /// [`Error::InvalidModel`] naming a type or key that is not implemented, or the two forms
    /// disagreeing where a config writes both.
    pub(super) fn read(&self, gemma: bool) -> Result<HfRope> {
        let legacy = Entry {
            theta: self.rope_theta,
            scaling: match &self.rope_scaling {
                None | Some(Value::Null) => None,
                Some(s) => entry("rope_scaling", s)?.scaling,
            },
            partial: self.partial_rotary_factor,
        };
        let (global, local_theta) = match &self.rope_parameters {
            None | Some(Value::Null) => (legacy, self.rope_local_base_freq),
            Some(p) => {
                let (global, local) = self.parameters(p, gemma)?;
                // A config may carry both forms; they must say the same thing.
                fn agree<T: PartialEq>(new: &Option<T>, old: &Option<T>) -> bool {
                    old.is_none() || new == old
                }
                for (name, same) in [
                    ("rope_theta", agree(&global.theta, &legacy.theta)),
                    ("rope_scaling", agree(&global.scaling, &legacy.scaling)),
                    (
                        "partial_rotary_factor",
                        legacy.partial.is_none()
                            || global.partial.is_none()
                            || global.partial == legacy.partial,
                    ),
                    (
                        "rope_local_base_freq",
                        agree(&local, &self.rope_local_base_freq),
                    ),
                ] {
                    if !same {
                        return Err(invalid(name, "differs from rope_parameters"));
                    }
                }
                let global = Entry {
                    partial: global.partial.or(legacy.partial),
                    ..global
                };
                (global, local.or(self.rope_local_base_freq))
            }
        };
        Ok(HfRope {
            global,
            local_theta,
            original: self.original_max_position_embeddings,
        })
    }

    /// 5.x's `rope_parameters`: one entry, or one per layer type (`full_attention`,
    /// `sliding_attention`) where the sliding layers may only differ in their base.
    fn parameters(&self, p: &Value, gemma: bool) -> Result<(Entry, Option<f32>)> {
        let per_type = p.as_object().is_some_and(|o| {
            o.contains_key("full_attention") || o.contains_key("sliding_attention")
        });
        if !per_type {
            return Ok((entry("rope_parameters", p)?, None));
        }
        let field = |t: &str| format!("rope_parameters.{t}");
        if let Some(key) = (p.as_object().into_iter().flat_map(|o| o.keys()))
            .find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention"))
        {
            return Err(invalid(&field(key), "is not a layer type"));
        }
        let full = match p.get("full_attention") {
            Some(v) => entry(&field("full_attention"), v)?,
            None => Entry::default(),
        };
        let sliding = match p.get("sliding_attention") {
            Some(v) => entry(&field("sliding_attention"), v)?,
            None => Entry::default(),
        };
        if sliding.scaling.is_some() || sliding.partial.is_some_and(|f| f != 1.0) {
            return Err(invalid(
                &field("sliding_attention"),
                "a scaling of the sliding-window layers is not supported",
            ));
        }
        // Only Gemma 3's local layers turn on a base of their own.
        if !gemma && sliding.theta.is_some() && sliding.theta != full.theta {
            return Err(invalid(
                &field("sliding_attention.rope_theta"),
                "a base of the sliding-window layers is supported for Gemma 3 only",
            ));
        }
        Ok((full, sliding.theta))
    }
}

impl HfRope {
    /// The base of the layers that attend globally.
    pub(super) fn base(&self) -> Option<f32> {
        self.global.theta
    }

    /// The base of the sliding-window layers, where the config gives one.
    pub(super) fn local_base(&self) -> Option<f32> {
        self.local_theta
    }

    /// The share of each head that rotates (Phi's), where the config gives one.
    pub(super) fn partial_rotary_factor(&self) -> Option<f64> {
        self.global.partial
    }

    fn scaling(&self, kinds: &[&str]) -> Option<&Scaling> {
        (self.global.scaling.as_ref()).filter(|s| kinds.contains(&s.kind.as_str()))
    }

    /// Llama 3's scaling, if it is the one.
    pub(super) fn llama3(&self) -> Result<Option<Llama3RopeScaling>> {
        self.scaling(&["llama3"])
            .map(|s| {
                serde_json::from_value(Value::Object(s.params.clone()))
                    .map_err(|e| invalid("rope_scaling", e))
            })
            .transpose()
    }

    /// A linear factor, if linear scaling is the one.
    pub(super) fn linear_factor(&self) -> Result<Option<f32>> {
        self.scaling(&["linear"])
            .map(|s| match s.params.get("factor").and_then(Value::as_f64) {
                Some(f) => Ok(f as f32),
                None => Err(invalid("rope_scaling.factor", "missing")),
            })
            .transpose()
    }

    /// LongRoPE's short and long factors and its attention factor, if it is the scaling,
    /// with the window the model was trained with where the config gives it.
    pub(super) fn longrope(&self) -> Result<Option<(LongRope, Option<usize>)>> {
        let Some(s) = self.scaling(&["longrope", "su"]) else {
            return Ok(None);
        };
        let factors = |key: &str| {
            serde_json::from_value::<Vec<f32>>(s.params.get(key).cloned().unwrap_or_default())
                .map_err(|e| invalid(&format!("rope_scaling.{key}"), e))
        };
        let attention = (s.params.get("attention_factor"))
            .and_then(Value::as_f64)
            .map(|f| f as f32);
        let original = (s.params.get("original_max_position_embeddings"))
            .and_then(Value::as_u64)
            .map(|o| o as usize)
            .or(self.original);
        Ok(Some((
            (factors("short_factor")?, factors("long_factor")?, attention),
            original,
        )))
    }

    /// YaRN's parameters, if it is the scaling.
    pub(super) fn yarn(&self) -> Result<Option<Yarn>> {
        let Some(s) = self.scaling(&["yarn"]) else {
            return Ok(None);
        };
        let mut yarn: Yarn = serde_json::from_value(Value::Object(s.params.clone()))
            .map_err(|e| invalid("rope_scaling", e))?;
        yarn.default_original(self.original);
        Ok(Some(yarn))
    }
}

#[cfg(test)]
mod tests {
    use crate::model::ModelConfig;
    use crate::Error;

    /// A small config of `arch`, with `rope` spliced in.
    fn config(arch: &str, rope: &str) -> String {
        format!(
            r#"{{"architectures":["{arch}"],"vocab_size":300,"hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":6,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"max_position_embeddings":256,
            "sliding_window":16,{rope}}}"#
        )
    }

    /// Each pair: 4.x's fields, and `rope_parameters` as transformers 5.25 saves the same
    /// config.
    const PAIRS: [(&str, &str, &str); 4] = [
        (
            "Gemma3ForCausalLM",
            r#""rope_theta":1000000.0,"rope_local_base_freq":10000.0,
               "rope_scaling":{"rope_type":"linear","factor":8.0}"#,
            r#""rope_parameters":{"full_attention":{"factor":8.0,"rope_theta":1000000.0,
               "rope_type":"linear"},"sliding_attention":{"rope_theta":10000.0,
               "rope_type":"default"}}"#,
        ),
        (
            "LlamaForCausalLM",
            r#""rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,
               "low_freq_factor":1.0,"high_freq_factor":4.0,
               "original_max_position_embeddings":64}"#,
            r#""rope_parameters":{"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
               "original_max_position_embeddings":64,"rope_theta":500000.0,
               "rope_type":"llama3"}"#,
        ),
        (
            "Qwen2ForCausalLM",
            r#""rope_theta":1000000.0,"rope_scaling":{"type":"yarn","factor":4.0,
               "original_max_position_embeddings":64}"#,
            r#""rope_parameters":{"factor":4.0,"original_max_position_embeddings":64,
               "rope_theta":1000000.0,"rope_type":"yarn"}"#,
        ),
        (
            "MistralForCausalLM",
            r#""rope_theta":1000000.0"#,
            r#""rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"}"#,
        ),
    ];

    #[test]
    fn both_forms_read_to_the_same_model() {
        for (arch, old, new) in PAIRS {
            let a = ModelConfig::from_hf_json(&config(arch, old)).unwrap();
            let b = ModelConfig::from_hf_json(&config(arch, new)).unwrap();
            assert_eq!(a, b, "{arch}");
            assert_ne!(a.rope.base, 10_000.0, "{arch}: the base was read");
            // Both forms at once, agreeing, read the same too.
            let both = ModelConfig::from_hf_json(&config(arch, &format!("{old},{new}")));
            assert_eq!(both.unwrap(), a, "{arch}");
        }
    }

    #[test]
    fn what_is_not_implemented_or_disagrees_is_refused_by_name() {
        let cases = [
            (
                "LlamaForCausalLM",
                r#""rope_parameters":{"rope_theta":1e6,"rope_type":"dynamic","factor":2.0}"#,
                "dynamic",
            ),
            (
                "LlamaForCausalLM",
                r#""rope_parameters":{"rope_theta":1e6,"rope_type":"linear","factor":2.0,
                   "low_freq_factor":1.0}"#,
                "rope_parameters.low_freq_factor",
            ),
            (
                "LlamaForCausalLM",
                r#""rope_parameters":{"rope_theta":1e6,"rope_type":"default","factor":2.0}"#,
                "rope_parameters.factor",
            ),
            (
                "LlamaForCausalLM",
                r#""rope_theta":1e4,"rope_parameters":{"rope_theta":1e6}"#,
                "rope_theta",
            ),
            (
                "LlamaForCausalLM",
                r#""rope_parameters":{"full_attention":{"rope_theta":1e6},
                   "sliding_attention":{"rope_theta":1e4}}"#,
                "sliding_attention.rope_theta",
            ),
            (
                "Gemma3ForCausalLM",
                r#""rope_parameters":{"full_attention":{"rope_theta":1e6},
                   "sliding_attention":{"rope_theta":1e4,"rope_type":"linear","factor":2.0}}"#,
                "rope_parameters.sliding_attention",
            ),
            (
                "Gemma3ForCausalLM",
                r#""rope_parameters":{"chunked_attention":{"rope_theta":1e6}}"#,
                "chunked_attention",
            ),
        ];
        for (arch, rope, named) in cases {
            match ModelConfig::from_hf_json(&config(arch, rope)) {
                Err(e @ Error::InvalidModel { .. }) => {
                    assert!(e.to_string().contains(named), "{rope}: {e}");
                }
                other => panic!("{rope}: {other:?}"),
            }
        }
    }
}
