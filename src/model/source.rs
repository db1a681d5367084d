//! Where a model comes from, and resolving that to local files.
//!
//! Sources: a local GGUF file, a local safetensors folder (`config.json`, `tokenizer.json`,
//! `model.safetensors` or an index of shards, optional `tokenizer_config.json` with the chat
//! template), a Hugging Face repo id fetched through `hf-hub` (its cache is read first, so a
//! populated cache works offline), and the default: SmolLM2-135M-Instruct as installed by
//! `scripts/fetch-assets`.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use crate::{Error, Result};

/// File name of the default model inside the asset cache.
const DEFAULT_GGUF: &str = "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Models `scripts/fetch-assets --model NAME` installs, by name, and their files in the cache.
pub const NAMED_MODELS: [(&str, &str); 2] = [
    ("smollm2-135m", DEFAULT_GGUF),
    ("gemma3-270m", "gemma3-270m/gemma-3-270m-q4_k_m.gguf"),
];

/// A model to load.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ModelSource {
    /// SmolLM2-135M-Instruct (GGUF Q4_1) in the asset cache (see [`default_cache_dir`]).
    #[default]
    Default,
    /// A local GGUF file.
    Gguf(PathBuf),
    /// A model of [`NAMED_MODELS`] in the asset cache, by name.
    Named(String),
    /// A local folder in Hugging Face layout with safetensors weights.
    Safetensors(PathBuf),
    /// A Hugging Face hub repository.
    Hub(HubSource),
}

/// A model on the Hugging Face hub.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubSource {
    /// Repository id, `org/name`.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
    /// A GGUF file in the repo to use; `None` means safetensors weights.
    pub gguf_file: Option<String>,
    /// The hub cache folder; `None` uses hf-hub's default (`HF_HOME`).
    pub cache_dir: Option<PathBuf>,
    /// Only read the cache, never the network.
    pub offline: bool,
    /// The access token sent to the hub (gated and private repositories); `None` reads the
    /// token file hf-hub keeps in the cache folder, if any.
    pub token: Option<String>,
    /// The hub's address; `None`: `https://huggingface.co`.
    pub endpoint: Option<String>,
}

impl HubSource {
    /// `repo` at `main`, safetensors, default cache, online.
    pub fn new(repo: impl Into<String>) -> Self {
        Self {
            repo: repo.into(),
            revision: "main".into(),
            gguf_file: None,
            cache_dir: None,
            offline: false,
            token: None,
            endpoint: None,
        }
    }

    /// The settings Hugging Face's own tools read from the environment, through `var`:
    /// `HF_TOKEN` (the access token), `HF_ENDPOINT` (a mirror or a private hub) and
    /// `HF_HUB_OFFLINE` (`1`, `true`, `yes` or `on`: the cache only). An empty value sets
    /// nothing, as in `huggingface_hub`.
    fn with_hf_env(mut self, var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        self.token = set("HF_TOKEN").or(self.token);
        self.endpoint = set("HF_ENDPOINT").or(self.endpoint);
        let on = |v: String| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on");
        self.offline |= set("HF_HUB_OFFLINE").is_some_and(on);
        self
    }
}

impl FromStr for ModelSource {
    type Err = Error;

    /// `default`; a path to a `.gguf` file; a path to a folder; or `org/name[@revision][:file.gguf]`.
    fn from_str(s: &str) -> Result<Self> {
        let path = Path::new(s);
        let repo_part = s.split([':', '@']).next().unwrap_or_default();
        let looks_like_repo = repo_part.split('/').count() == 2
            && !repo_part.starts_with(['.', '/', '~'])
            && repo_part.split('/').all(|p| !p.is_empty());
        if s == "default" || s.is_empty() {
            Ok(Self::Default)
        } else if NAMED_MODELS.iter().any(|(name, _)| *name == s) {
            Ok(Self::Named(s.to_string()))
        } else if path.is_dir() {
            Ok(Self::Safetensors(path.to_path_buf()))
        } else if path.is_file()
            || (!looks_like_repo && path.extension().is_some_and(|e| e == "gguf"))
        {
            Ok(Self::Gguf(path.to_path_buf()))
        } else if looks_like_repo {
            let (rest, gguf_file) = match s.split_once(':') {
                Some((r, f)) => (r, Some(f.to_string())),
                None => (s, None),
            };
            let (repo, revision) = rest.split_once('@').unwrap_or((rest, "main"));
            let hub = HubSource {
                revision: revision.into(),
                gguf_file,
                ..HubSource::new(repo)
            };
            Ok(Self::Hub(hub.with_hf_env(|k| std::env::var(k).ok())))
        } else {
            Err(Error::invalid_model(
                s,
                "not a .gguf file, a model folder or an org/name repo id",
            ))
        }
    }
}

/// The asset cache: `$PENSIEVE_CACHE`, else `~/.cache/pensieve` (as `scripts/fetch-assets`).
pub fn default_cache_dir() -> PathBuf {
    match std::env::var_os("PENSIEVE_CACHE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."))
            .join(".cache/pensieve"),
    }
}

/// Path of the default model file in the asset cache (it may not exist yet).
pub fn default_model_path() -> PathBuf {
    default_cache_dir().join(DEFAULT_GGUF)
}

/// Local files of a resolved source.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResolvedFiles {
    /// One GGUF file with weights, tokenizer and template.
    Gguf(PathBuf),
    /// Hugging Face layout.
    Safetensors {
        /// `config.json`.
        config: PathBuf,
        /// `tokenizer.json`.
        tokenizer: PathBuf,
        /// `tokenizer_config.json`, if present (chat template, special tokens).
        tokenizer_config: Option<PathBuf>,
        /// `generation_config.json`, if present (sampling defaults, ends of generation).
        generation_config: Option<PathBuf>,
        /// The weight shards.
        weights: Vec<PathBuf>,
    },
}

impl ModelSource {
    /// Finds (or, for the hub, fetches) the files of this source.
    ///
    /// # Errors
    /// [`Error::AssetsMissing`] for an unfetched default, [`Error::Io`] for missing local
    /// files, [`Error::Hub`] when the hub or its cache cannot provide a file.
    pub fn resolve(&self) -> Result<ResolvedFiles> {
        match self {
            Self::Default => cached(default_model_path(), ""),
            Self::Named(name) => match NAMED_MODELS.iter().find(|(n, _)| n == name) {
                Some((_, file)) => {
                    cached(default_cache_dir().join(file), &format!(" --model {name}"))
                }
                None => Err(Error::invalid_model(
                    name.as_str(),
                    format!(
                        "not a named model (named: {})",
                        NAMED_MODELS.map(|(n, _)| n).join(", ")
                    ),
                )),
            },
            Self::Gguf(p) => {
                std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
                Ok(ResolvedFiles::Gguf(p.clone()))
            }
            Self::Safetensors(dir) => resolve_folder(
                |f| {
                    let p = dir.join(f);
                    Ok(p.is_file().then_some(p))
                },
                |f| dir.join(f).is_file(),
            ),
            Self::Hub(hub) => resolve_hub(hub),
        }
    }
}

/// A file of the asset cache, or how to fetch it.
fn cached(path: PathBuf, fetch_args: &str) -> Result<ResolvedFiles> {
    if path.is_file() {
        Ok(ResolvedFiles::Gguf(path))
    } else {
        Err(Error::AssetsMissing {
            path,
            fetch_args: fetch_args.into(),
        })
    }
}

/// Resolves the Hugging Face layout through `fetch`, which returns `None` for absent files;
/// `held` says whether a file is at hand without asking anyone (in the folder, in the hub's
/// cache), so that a cache holding a sharded repository's index loads its shards without
/// asking the hub whether a single `model.safetensors` exists.
fn resolve_folder(
    fetch: impl Fn(&str) -> Result<Option<PathBuf>>,
    held: impl Fn(&str) -> bool,
) -> Result<ResolvedFiles> {
    let required = |f: &str| {
        fetch(f)?.ok_or_else(|| {
            Error::io(
                f,
                std::io::Error::new(std::io::ErrorKind::NotFound, "required model file missing"),
            )
        })
    };
    const INDEX: &str = "model.safetensors.index.json";
    let single = match held(INDEX) && !held("model.safetensors") {
        true => None,
        false => fetch("model.safetensors")?,
    };
    let weights = match single {
        Some(p) => vec![p],
        None => {
            let index = required(INDEX)?;
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::invalid_model(index.display().to_string(), e))?;
            let mut shards: Vec<String> = json["weight_map"]
                .as_object()
                .ok_or_else(|| Error::invalid_model(index.display().to_string(), "no weight_map"))?
                .values()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            shards.sort();
            shards.dedup();
            shards.iter().map(|s| required(s)).collect::<Result<_>>()?
        }
    };
    Ok(ResolvedFiles::Safetensors {
        config: required("config.json")?,
        tokenizer: required("tokenizer.json")?,
        tokenizer_config: fetch("tokenizer_config.json")?,
        // Sampling defaults are a nicety: a hub that cannot say whether the repo has them
        // (offline with a populated cache) leaves them out rather than failing the load.
        generation_config: match fetch("generation_config.json") {
            Err(e @ Error::Hub { .. }) => {
                tracing::warn!(error = %e, "generation_config.json unavailable: no sampling defaults");
                None
            }
            other => other?,
        },
        weights,
    })
}

fn resolve_hub(hub: &HubSource) -> Result<ResolvedFiles> {
    let repo = Repo::with_revision(hub.repo.clone(), RepoType::Model, hub.revision.clone());
    let cache = match &hub.cache_dir {
        Some(d) => Cache::new(d.clone()),
        None => Cache::from_env(),
    };
    let hub_err = |file: Option<&str>, e: Box<dyn std::error::Error + Send + Sync>| Error::Hub {
        repo: hub.repo.clone(),
        file: file.map(str::to_string),
        source: e,
    };
    let api = if hub.offline {
        None
    } else {
        // Download bars on a terminal; a log or a pipe gets none.
        let bars = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let mut builder = ApiBuilder::from_cache(cache.clone()).with_progress(bars);
        if let Some(token) = &hub.token {
            builder = builder.with_token(Some(token.clone()));
        }
        if let Some(endpoint) = &hub.endpoint {
            builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
        }
        Some(
            builder
                .build()
                .map_err(|e| hub_err(None, e.into()))?
                .repo(repo.clone()),
        )
    };
    let cached = cache.repo(repo);
    // Online, the repo's file list tells a missing file from a failed download; asked for only
    // when the cache lacks a file, so a populated cache never touches the network.
    let listing: RefCell<Option<Vec<String>>> = RefCell::new(None);
    let fetch = |file: &str| -> Result<Option<PathBuf>> {
        if let Some(p) = cached.get(file) {
            return Ok(Some(p));
        }
        let Some(api) = &api else { return Ok(None) };
        if listing.borrow().is_none() {
            let info = api.info().map_err(|e| hub_err(None, e.into()))?;
            *listing.borrow_mut() = Some(info.siblings.into_iter().map(|s| s.rfilename).collect());
        }
        let listed = listing
            .borrow()
            .as_ref()
            .is_some_and(|l| l.iter().any(|f| f == file));
        if listed {
            api.get(file)
                .map(Some)
                .map_err(|e| hub_err(Some(file), e.into()))
        } else {
            Ok(None)
        }
    };
    match &hub.gguf_file {
        Some(f) => fetch(f)?.map(ResolvedFiles::Gguf).ok_or_else(|| {
            let missing =
                std::io::Error::new(std::io::ErrorKind::NotFound, "not in the repo or its cache");
            hub_err(Some(f), missing.into())
        }),
        None => resolve_folder(fetch, |f| cached.get(f).is_some()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_face_s_environment_is_read_as_its_tools_read_it() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let hub = HubSource::new("a/b").with_hf_env(env(&[
            ("HF_TOKEN", "hf_x"),
            ("HF_ENDPOINT", "http://mirror"),
            ("HF_HUB_OFFLINE", "True"),
        ]));
        assert_eq!(hub.token.as_deref(), Some("hf_x"));
        assert_eq!(hub.endpoint.as_deref(), Some("http://mirror"));
        assert!(hub.offline);
        let hub =
            HubSource::new("a/b").with_hf_env(env(&[("HF_TOKEN", ""), ("HF_HUB_OFFLINE", "0")]));
        assert_eq!((hub.token, hub.offline), (None, false));
    }
}
