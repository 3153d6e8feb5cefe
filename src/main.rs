//! `switchyard`: the command line. Each subcommand parses its flags and hands over to the
//! library; nothing else lives here.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use switchyard::sim::{ExitMode, FaultSpec, Profile, SimConfig, SimServer};

#[derive(Debug, Parser)]
#[command(
    name = "switchyard",
    version,
    about = "One OpenAI-compatible LLM serving platform for every GPU a company owns."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Everything on one machine: a simulated fleet (until the server lands, the engines only).
    Demo(DemoArgs),
    /// A vLLM simulator: vLLM's API, metrics and timing on one port.
    Sim(SimArgs),
}

#[derive(Debug, Args)]
struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Model name served, exactly as the server knows it.
    #[arg(long)]
    model: String,
    /// Model size and hardware: 8b (1x L40S), 32b (2x L40S), 70b FP8 (4x L40S).
    #[arg(long, default_value = "8b")]
    profile: Profile,
    /// Divide every delay by this factor (tests run at 10-100).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Most sequences in one batch.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Context limit in tokens (default: the profile's).
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Token budget of one engine step (chunked prefill).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: u32,
    /// Fraction of GPU memory the engine takes.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    /// Use exactly this many KV blocks instead of the profile's arithmetic.
    #[arg(long)]
    num_gpu_blocks_override: Option<u64>,
    /// Mean answer length of requests without max_tokens (they end at a drawn EOS).
    #[arg(long, default_value_t = 256)]
    natural_output_tokens: u32,
    /// Fault: cut every stream after this many tokens.
    #[arg(long)]
    fault_crash_after_tokens: Option<u32>,
    /// Fault: every stream stops sending after this many tokens, socket kept open.
    #[arg(long)]
    fault_stall_after_tokens: Option<u32>,
    /// Fault: the next K chat requests get HTTP 500.
    #[arg(long)]
    fault_http_500: Option<u32>,
    /// Fault: extra delay before each first token, engine milliseconds.
    #[arg(long)]
    fault_slow_first_token_ms: Option<u64>,
    /// Report "loading" (503 on /health) for this long after start, engine milliseconds.
    #[arg(long)]
    load_delay_ms: Option<u64>,
    /// Fault: exit the process (status 137) after this many engine milliseconds.
    #[arg(long)]
    fault_exit_after_ms: Option<u64>,
}

impl SimArgs {
    fn config(&self) -> SimConfig {
        SimConfig {
            model: self.model.clone(),
            profile: self.profile,
            time_scale: self.time_scale,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            max_num_batched_tokens: self.max_num_batched_tokens,
            gpu_memory_utilization: self.gpu_memory_utilization,
            num_gpu_blocks_override: self.num_gpu_blocks_override,
            natural_output_tokens: self.natural_output_tokens,
            faults: FaultSpec {
                crash_after_tokens: self.fault_crash_after_tokens,
                stall_after_tokens: self.fault_stall_after_tokens,
                http_500: self.fault_http_500,
                slow_first_token_ms: self.fault_slow_first_token_ms,
                load_delay_ms: self.load_delay_ms,
                exit_after_ms: self.fault_exit_after_ms,
            },
            exit_mode: ExitMode::Process,
        }
    }
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// First address; the simulated engines take the following ports.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Engines per model alias.
    #[arg(long, default_value = "small=2,medium=1,large=1")]
    nodes: String,
    /// Divide every delay by this factor.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
}

/// The demo fleet's models: alias, served name, profile.
const DEMO_MODELS: [(&str, &str, Profile); 3] = [
    ("small", "llama-3.1-8b-instruct", Profile::B8),
    ("medium", "qwen2.5-32b-instruct", Profile::B32),
    ("large", "llama-3.3-70b-instruct", Profile::B70),
];

fn parse_nodes(spec: &str) -> anyhow::Result<Vec<(&'static str, &'static str, Profile, u32)>> {
    let mut out = Vec::new();
    for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
        let (alias, count) = part
            .split_once('=')
            .context("--nodes takes alias=count,…")?;
        let (alias, name, profile) = DEMO_MODELS
            .iter()
            .copied()
            .find(|(a, _, _)| *a == alias.trim())
            .with_context(|| format!("unknown model alias `{alias}` (small, medium, large)"))?;
        let count: u32 = count
            .trim()
            .parse()
            .with_context(|| format!("bad node count in `{part}`"))?;
        out.push((alias, name, profile, count));
    }
    Ok(out)
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let mut sims = Vec::new();
    let mut port = args.listen.port();
    for (alias, name, profile, count) in parse_nodes(&args.nodes)? {
        for _ in 0..count {
            port = port.checked_add(1).context("ran out of ports")?;
            let config = SimConfig {
                model: name.to_string(),
                profile,
                time_scale: args.time_scale,
                ..SimConfig::default()
            };
            let addr = SocketAddr::new(args.listen.ip(), port);
            let sim = SimServer::bind(config, addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            println!(
                "{alias:<7} {name:<24} profile {profile:<4} {}/v1",
                sim.base_url()
            );
            sims.push(sim);
        }
    }
    if let Some(first) = sims.first() {
        let base = first.base_url();
        println!(
            "\nTry it (streams from a simulated {} engine):",
            DEMO_MODELS[0].1
        );
        println!(
            "  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"max_tokens\":32,\"stream\":true}}'",
            DEMO_MODELS[0].1
        );
    }
    println!("\nCtrl-C stops the demo.");
    shutdown_signal().await;
    for sim in sims {
        sim.shutdown().await;
    }
    Ok(())
}

async fn sim(args: SimArgs) -> anyhow::Result<()> {
    let server = SimServer::bind(args.config(), args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tokio::select! {
        () = shutdown_signal() => server.shutdown().await,
        () = server.stopped() => {}
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = std::env::var("SWITCHYARD_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    match Cli::parse().command {
        Command::Demo(args) => demo(args).await,
        Command::Sim(args) => sim(args).await,
    }
}
