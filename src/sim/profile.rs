//! Hardware and model profiles for the simulator, and the KV-cache arithmetic behind them.
//!
//! A profile is the physics of one model replica: how much KV memory a token costs, how many
//! tokens fit on the GPUs after weights and activations, and how long a decode step takes.
//! The numbers reproduce SPEC section 1 (see docs/capacity.md for the derivation).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The three model sizes the platform serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profile {
    /// Llama 3.1 8B Instruct, bf16, one L40S.
    #[default]
    B8,
    /// Qwen 2.5 32B Instruct, bf16, two L40S (tensor parallel 2).
    B32,
    /// Llama 3.3 70B Instruct, FP8 weights, four L40S (tensor parallel 4).
    B70,
}

impl Profile {
    /// The profile's physical description.
    pub fn spec(self) -> ProfileSpec {
        match self {
            // Weights 15 GiB read once per step at 864 GB/s = 18.6 ms; the per-sequence cost is
            // what makes 32 streams decode at 47 tok/s each (1/47 s per step).
            Profile::B8 => ProfileSpec {
                name: "8b",
                layers: 32,
                kv_heads: 8,
                head_dim: 128,
                kv_dtype_bytes: 2,
                gpus: 1,
                gpu_memory_gib: 44.0,
                weights_gib: 15.0,
                activations_gib_per_gpu: 2.0,
                memory_bandwidth_gb_s: 864.0,
                step_per_seq_us: 82.4,
                prefill_tokens_per_s: 6_000.0,
                max_model_len: 8192,
            },
            // 64 GB of bf16 weights over two GPUs: 30.5 GiB per GPU per step.
            Profile::B32 => ProfileSpec {
                name: "32b",
                layers: 64,
                kv_heads: 8,
                head_dim: 128,
                kv_dtype_bytes: 2,
                gpus: 2,
                gpu_memory_gib: 44.0,
                weights_gib: 61.0,
                activations_gib_per_gpu: 2.0,
                memory_bandwidth_gb_s: 864.0,
                step_per_seq_us: 250.0,
                prefill_tokens_per_s: 2_800.0,
                max_model_len: 8192,
            },
            // 70B in FP8 over four GPUs; the per-sequence cost (tensor-parallel all-reduce and
            // dequantisation) makes 8 streams total 300 tok/s.
            Profile::B70 => ProfileSpec {
                name: "70b",
                layers: 80,
                kv_heads: 8,
                head_dim: 128,
                kv_dtype_bytes: 2,
                gpus: 4,
                gpu_memory_gib: 44.0,
                weights_gib: 65.7,
                activations_gib_per_gpu: 2.0,
                memory_bandwidth_gb_s: 864.0,
                step_per_seq_us: 784.0,
                prefill_tokens_per_s: 5_000.0,
                max_model_len: 8192,
            },
        }
    }
}

impl FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "8b" => Ok(Profile::B8),
            "32b" => Ok(Profile::B32),
            "70b" => Ok(Profile::B70),
            other => Err(format!(
                "unknown profile `{other}` (expected 8b, 32b or 70b)"
            )),
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.spec().name)
    }
}

/// Where the engine's timing comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Timing {
    /// Continuous batching over a paged KV cache, timed by the [`Profile`]'s physics.
    #[default]
    Modeled,
    /// `--profile fixed`: no batching or KV model; every stream's first token comes exactly
    /// `ttft` after it arrives, then one token every `itl`, however many streams run. Both are
    /// engine time (divided by the time scale). For benchmarks of the gateway's own overhead.
    Fixed {
        /// Time to first token.
        ttft: Duration,
        /// Time between two tokens.
        itl: Duration,
    },
}

impl Timing {
    /// Default time to first token of `--profile fixed`, in milliseconds.
    pub const FIXED_TTFT_MS: u64 = 50;
    /// Default inter-token latency of `--profile fixed`, in milliseconds.
    pub const FIXED_ITL_MS: u64 = 20;

    /// Fixed timing from milliseconds.
    pub fn fixed_ms(ttft_ms: u64, itl_ms: u64) -> Self {
        Timing::Fixed {
            ttft: Duration::from_millis(ttft_ms),
            itl: Duration::from_millis(itl_ms),
        }
    }
}

/// What `--profile` names: a modeled replica (`8b`, `32b`, `70b`) or `fixed` timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfileArg {
    /// A modeled replica.
    Modeled(Profile),
    /// Fixed timing (`--ttft-ms`, `--itl-ms`).
    Fixed,
}

impl FromStr for ProfileArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fixed" => Ok(ProfileArg::Fixed),
            other => other
                .parse()
                .map(ProfileArg::Modeled)
                .map_err(|_| format!("unknown profile `{other}` (expected 8b, 32b, 70b or fixed)")),
        }
    }
}

impl fmt::Display for ProfileArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProfileArg::Modeled(p) => p.fmt(f),
            ProfileArg::Fixed => f.write_str("fixed"),
        }
    }
}

/// One model replica's physics.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileSpec {
    /// `8b`, `32b` or `70b`.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u64,
    /// Key-value heads (grouped-query attention).
    pub kv_heads: u64,
    /// Dimension of one head.
    pub head_dim: u64,
    /// Bytes per KV element (2 for bf16/fp16).
    pub kv_dtype_bytes: u64,
    /// GPUs in one replica (tensor parallel size).
    pub gpus: u64,
    /// Usable memory of one GPU (an L40S has 48 GB, about 44 GiB).
    pub gpu_memory_gib: f64,
    /// Weights of the whole model, all GPUs together.
    pub weights_gib: f64,
    /// Activation and workspace memory per GPU.
    pub activations_gib_per_gpu: f64,
    /// Memory bandwidth of one GPU, which bounds a decode step.
    pub memory_bandwidth_gb_s: f64,
    /// Added step time per sequence in the batch.
    pub step_per_seq_us: f64,
    /// Prompt tokens processed per second when prefilling.
    pub prefill_tokens_per_s: f64,
    /// Default `--max-model-len`.
    pub max_model_len: u32,
}

impl ProfileSpec {
    /// KV-cache bytes one token occupies: keys and values, every layer, every KV head.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes
    }

    /// KV-cache memory left after vLLM takes `gpu_memory_utilization` of every GPU and the
    /// weights and activations are placed; never negative.
    pub fn kv_cache_gib(&self, gpu_memory_utilization: f64) -> f64 {
        let usable = self.gpu_memory_gib * gpu_memory_utilization * self.gpus as f64;
        let taken = self.weights_gib + self.activations_gib_per_gpu * self.gpus as f64;
        (usable - taken).max(0.0)
    }

    /// Number of KV blocks of `block_size` tokens that fit.
    pub fn num_gpu_blocks(&self, gpu_memory_utilization: f64, block_size: u32) -> u64 {
        let bytes = self.kv_cache_gib(gpu_memory_utilization) * GIB;
        let block_bytes = self.kv_bytes_per_token() * u64::from(block_size);
        if block_bytes == 0 {
            return 0;
        }
        (bytes / block_bytes as f64).floor() as u64
    }

    /// Fixed part of a decode step: one pass over the weights held by each GPU.
    pub fn step_base(&self) -> Duration {
        let bytes_per_gpu = self.weights_gib * GIB / self.gpus as f64;
        Duration::from_secs_f64(bytes_per_gpu / (self.memory_bandwidth_gb_s * 1e9))
    }

    /// Duration of one engine step with `decoding` sequences producing a token each and
    /// `prefill_tokens` prompt tokens processed alongside (chunked prefill).
    pub fn step_duration(&self, decoding: usize, prefill_tokens: u64) -> Duration {
        let per_seq = self.step_per_seq_us * 1e-6 * decoding as f64;
        let prefill = prefill_tokens as f64 / self.prefill_tokens_per_s;
        self.step_base() + Duration::from_secs_f64(per_seq + prefill)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok_s_per_stream(p: &ProfileSpec, b: usize) -> f64 {
        1.0 / p.step_duration(b, 0).as_secs_f64()
    }

    #[test]
    fn eight_b_kv_arithmetic_matches_spec_section_1() {
        let p = Profile::B8.spec();
        assert_eq!(p.kv_bytes_per_token(), 128 * 1024);
        assert!((p.kv_cache_gib(0.9) - 22.6).abs() < 1e-9);
        let blocks = p.num_gpu_blocks(0.9, 16);
        let tokens = blocks * 16;
        assert_eq!(tokens / 2048, 90, "about 90 streams at 2k context");
        assert_eq!(tokens / 8192, 22, "22 streams at 8k context");
    }

    #[test]
    fn eight_b_decode_rate_matches_spec_section_1() {
        let p = Profile::B8.spec();
        let per_stream = tok_s_per_stream(&p, 32);
        assert!((per_stream - 47.0).abs() < 1.0, "{per_stream}");
        let total = per_stream * 32.0;
        assert!((total - 1500.0).abs() < 50.0, "{total}");
    }

    #[test]
    fn seventy_b_decode_rate_matches_spec_section_1() {
        let p = Profile::B70.spec();
        let total = tok_s_per_stream(&p, 8) * 8.0;
        assert!((total - 300.0).abs() < 15.0, "{total}");
        assert!(
            p.num_gpu_blocks(0.9, 16) * 16 >= 8 * 8192,
            "8 streams at 8k fit"
        );
    }

    #[test]
    fn thirty_two_b_fits_sixteen_streams_at_2k() {
        let p = Profile::B32.spec();
        assert!(p.num_gpu_blocks(0.9, 16) * 16 >= 16 * 2048);
        let per_stream = tok_s_per_stream(&p, 16);
        assert!(
            per_stream >= 20.0,
            "SLI floor of 20 tok/s per stream: {per_stream}"
        );
    }

    #[test]
    fn profiles_parse_and_print() {
        for p in [Profile::B8, Profile::B32, Profile::B70] {
            assert_eq!(p.to_string().parse::<Profile>(), Ok(p));
        }
        assert!("9b".parse::<Profile>().is_err());
        assert_eq!("fixed".parse::<ProfileArg>(), Ok(ProfileArg::Fixed));
        assert_eq!(
            "70b".parse::<ProfileArg>(),
            Ok(ProfileArg::Modeled(Profile::B70))
        );
        assert!("fixed".parse::<Profile>().is_err());
        assert!("9b".parse::<ProfileArg>().is_err());
    }
}
