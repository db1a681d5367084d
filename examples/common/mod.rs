//! Command-line flags shared by the examples that build an engine: model, weight format,
//! cache mode and budgets.

use clap::{Args, ValueEnum};
use pensieve::engine::{Budgets, CacheMode};
use pensieve::model::{LoadOptions, Model, ModelSource, WeightFormat};

/// Cache mode, as the papers name the three systems.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// KV released after every turn (vLLM-style).
    Stateless,
    /// Device pool only; evicted KV is dropped.
    DeviceOnly,
    /// Device pool plus host tier (Pensieve).
    Tiered,
}

impl Mode {
    /// All three, baseline first.
    #[allow(dead_code)] // used by replay only
    pub const ALL: [Mode; 3] = [Mode::Stateless, Mode::DeviceOnly, Mode::Tiered];

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Stateless => "stateless",
            Mode::DeviceOnly => "device-only",
            Mode::Tiered => "tiered",
        }
    }

    /// The engine's mode.
    pub fn cache_mode(self) -> CacheMode {
        match self {
            Mode::Stateless => CacheMode::Stateless,
            Mode::DeviceOnly => CacheMode::DeviceOnly,
            Mode::Tiered => CacheMode::Tiered,
        }
    }
}

/// In-memory weight format.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    F32,
    F16,
    Quantized,
    Mixed,
}

/// Flags for the model and the engine's cache.
#[derive(Args, Debug)]
pub struct EngineArgs {
    /// Model: `default`, a .gguf file, a safetensors folder, or an `org/name` hub repo.
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Weight format.
    #[arg(long, value_enum, default_value = "mixed")]
    pub format: Format,
    /// Cache mode.
    #[arg(long, value_enum, default_value = "tiered")]
    pub mode: Mode,
    /// Device KV pool in tokens.
    #[arg(long, default_value_t = 8192)]
    pub device_tokens: usize,
    /// Host KV tier in MiB.
    #[arg(long, default_value_t = 1024)]
    pub host_mib: usize,
}

impl EngineArgs {
    /// Load options for `--format` on the CPU.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            format: match self.format {
                Format::F32 => WeightFormat::F32,
                Format::F16 => WeightFormat::F16,
                Format::Quantized => WeightFormat::Quantized,
                Format::Mixed => WeightFormat::Mixed,
            },
            ..LoadOptions::default()
        }
    }

    /// Loads `--model`.
    pub fn load_model(&self) -> Result<Model, Box<dyn std::error::Error>> {
        eprintln!("loading {} ...", self.model);
        let source: ModelSource = self.model.parse()?;
        Ok(Model::load(&source, &self.load_options())?)
    }

    /// The budgets of `--device-tokens` and `--host-mib`.
    pub fn budgets(&self) -> Budgets {
        Budgets {
            device_tokens: self.device_tokens,
            device_bytes: None,
            host_bytes: self.host_mib << 20,
        }
    }
}
