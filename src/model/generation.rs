//! Sampling defaults a Hugging Face checkpoint ships in `generation_config.json`: what its
//! authors tuned the model to be sampled with. A server applies them to the fields a request
//! leaves unset, as vLLM does (`--generation-config auto`); the library's own
//! [`crate::engine::SamplingParams`] are never changed behind a caller's back.

use crate::{Error, Result};

/// The sampling fields of `generation_config.json` that vLLM takes as defaults, and the tokens
/// it lists as ends of generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f32>,
    /// `eos_token_id`: one id or several (Llama 3 lists end of text, end of message and end
    /// of turn).
    pub eos_token_ids: Vec<u32>,
}

impl GenerationDefaults {
    /// Reads the text of a `generation_config.json`. Fields absent or `null` stay unset; a
    /// `top_k` of 0 means no truncation (unset).
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for text that is not a JSON object, or a field of the wrong type.
    pub fn from_json(text: &str) -> Result<Self> {
        let bad = |what: &str| Error::invalid_model("generation_config.json", what.to_string());
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid_model("generation_config.json", e))?;
        if !v.is_object() {
            return Err(bad("not a JSON object"));
        }
        let number = |key: &str| -> Result<Option<f64>> {
            match &v[key] {
                serde_json::Value::Null => Ok(None),
                x => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| bad(&format!("{key} is not a number"))),
            }
        };
        let eos_token_ids = match &v["eos_token_id"] {
            serde_json::Value::Null => Vec::new(),
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| x.as_u64().map(|i| i as u32))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| bad("eos_token_id holds a non-integer"))?,
            x => vec![x
                .as_u64()
                .ok_or_else(|| bad("eos_token_id is not an integer"))?
                as u32],
        };
        Ok(Self {
            temperature: number("temperature")?,
            top_p: number("top_p")?,
            top_k: number("top_k")?.filter(|&k| k >= 1.0).map(|k| k as usize),
            min_p: number("min_p")?,
            repetition_penalty: number("repetition_penalty")?.map(|x| x as f32),
            eos_token_ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_llama_3_generation_config_reads_its_defaults_and_ends() -> Result<()> {
        let d = GenerationDefaults::from_json(
            r#"{"bos_token_id": 128000, "do_sample": true, "eos_token_id": [128001, 128008, 128009],
                "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0"}"#,
        )?;
        assert_eq!(
            d,
            GenerationDefaults {
                temperature: Some(0.6),
                top_p: Some(0.9),
                eos_token_ids: vec![128001, 128008, 128009],
                ..GenerationDefaults::default()
            }
        );
        let d = GenerationDefaults::from_json(
            r#"{"eos_token_id": 2, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1}"#,
        )?;
        assert_eq!(
            (d.top_k, d.min_p, d.repetition_penalty, d.eos_token_ids),
            (None, Some(0.05), Some(1.1), vec![2])
        );
        for bad in [
            "[1]",
            r#"{"temperature": "hot"}"#,
            r#"{"eos_token_id": [1.5]}"#,
        ] {
            assert!(matches!(
                GenerationDefaults::from_json(bad),
                Err(Error::InvalidModel { .. })
            ));
        }
        Ok(())
    }
}
