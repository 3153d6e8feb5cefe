//! `switchyard`: the command line. Each subcommand parses its flags and hands over to the
//! library; nothing else lives here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use switchyard::config::Config;
use switchyard::coord::{Coordinator, RedisCoordinator, RedisCoordinatorOptions};
use switchyard::demo::{self, Fleet, FleetConfig};
use switchyard::node_agent::{self, AgentConfig, NodeToken};
use switchyard::server::Server;
use switchyard::sim::{ExitMode, FaultSpec, Profile, ProfileArg, SimConfig, SimServer, Timing};
use switchyard::{coord, store};
use switchyard_actors::protocol::Location;
use tokio_util::sync::CancellationToken;

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
    /// Everything on one machine: server, simulated GPU nodes with real agents, no services.
    Demo(DemoArgs),
    /// The production server (gateway and orchestrator).
    Serve(ServeArgs),
    /// The agent on a GPU node: dials the server and forwards work to the local engine.
    Node(NodeArgs),
    /// A vLLM simulator: vLLM's API, metrics and timing on one port.
    Sim(SimArgs),
    /// Applies database migrations.
    Migrate(MigrateArgs),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// TOML configuration file (defaults otherwise; SWITCHYARD_* variables override both).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on (overrides the file and SWITCHYARD_LISTEN).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Do not apply migrations at start.
    #[arg(long)]
    no_migrate: bool,
}

#[derive(Debug, Args)]
struct MigrateArgs {
    /// TOML configuration file (for database_url; DATABASE_URL overrides).
    #[arg(long)]
    config: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct NodeArgs {
    /// The server's base URL (http://… or https://…): its load balancer, or several replicas
    /// separated by commas, tried in turn after a lost connection.
    #[arg(long)]
    server: String,
    /// This node's id, as issued with its token.
    #[arg(long)]
    node_id: String,
    /// The per-node token (or SWITCHYARD_NODE_TOKEN); give this or --token-file.
    #[arg(long, env = switchyard::env_names::NODE_TOKEN, hide_env_values = true)]
    token: Option<String>,
    /// File holding the per-node token (a mounted Kubernetes Secret), trimmed; read again
    /// before every reconnect, so a rotated Secret takes effect without a restart.
    #[arg(long, env = switchyard::env_names::NODE_TOKEN_FILE)]
    token_file: Option<PathBuf>,
    /// GPUs on this node, registered with the server: the cost report's GPU hours are the
    /// node's connected hours times this.
    #[arg(long, env = switchyard::env_names::NODE_GPUS, default_value_t = 0)]
    gpus: u32,
    /// Model name of those GPUs, as registered (e.g. "NVIDIA L40S").
    #[arg(long, default_value = "unknown")]
    gpu_name: String,
    /// Memory of one of those GPUs, MiB, as registered.
    #[arg(long, default_value_t = 0)]
    gpu_memory_mib: u64,
    /// On SIGTERM or SIGINT, how long in-flight work may run on before it is stopped and the
    /// agent exits (a second signal stops at once): 110s, 2m, 500ms, 1m30s.
    #[arg(long, default_value = "110s", value_parser = parse_duration)]
    drain_timeout: Duration,
    /// The engine runs vLLM's `--scheduling-policy priority`: each request carries its
    /// service tier as vLLM's `priority` (priority 0, default 1, flex 2), so the engine runs
    /// and preempts by tier. Off, the body reaches the engine as the server sent it (vLLM
    /// 0.32 scheduling first come, first served accepts and ignores the field).
    #[arg(long, env = switchyard::env_names::ENGINE_PRIORITY)]
    engine_priority: bool,
    /// The local engine's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    engine: String,
    /// Where the node runs.
    #[arg(long, default_value = "onprem", value_parser = parse_location)]
    location: Location,
    /// PEM file of CAs trusted for an https:// server besides the web PKI roots.
    #[arg(long, env = switchyard::env_names::NODE_CA_FILE)]
    ca_file: Option<PathBuf>,
}

/// `110s`, `2m`, `500ms`, `1h`, `1m30s` or plain seconds (`110`).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("`{s}`: expected a duration such as 110s, 2m, 500ms or 1m30s");
    let mut rest = s.trim();
    if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) {
        return rest.parse().map(Duration::from_secs).map_err(|_| bad());
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let value: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(value),
            "s" => Duration::from_secs(value),
            "m" => Duration::from_secs(value.saturating_mul(60)),
            "h" => Duration::from_secs(value.saturating_mul(3_600)),
            _ => return Err(bad()),
        };
        total = total.saturating_add(part);
        rest = &rest[unit_len..];
    }
    if total.is_zero() {
        return Err(bad());
    }
    Ok(total)
}

fn parse_location(s: &str) -> Result<Location, String> {
    match s {
        "onprem" => Ok(Location::Onprem),
        "cloud" => Ok(Location::Cloud),
        _ => Err(format!("`{s}`: expected onprem or cloud")),
    }
}

#[derive(Debug, Args)]
struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Model name served, exactly as the server knows it.
    #[arg(long)]
    model: String,
    /// Model size and hardware: 8b (1x L40S), 32b (2x L40S), 70b FP8 (4x L40S); or `fixed`:
    /// no batching model, first token after --ttft-ms, then one every --itl-ms, per stream.
    #[arg(long, default_value = "8b")]
    profile: ProfileArg,
    /// With --profile fixed: time to first token, engine milliseconds [default: 50].
    #[arg(long)]
    ttft_ms: Option<u64>,
    /// With --profile fixed: time between tokens, engine milliseconds [default: 20].
    #[arg(long)]
    itl_ms: Option<u64>,
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
    /// Also serve this embedding model on /v1/embeddings.
    #[arg(long)]
    embedding_model: Option<String>,
    /// Report prompt_tokens_details.cached_tokens in usage (vLLM's flag of the same name).
    #[arg(long)]
    enable_prompt_tokens_details: bool,
    /// Turn prefix caching off (vLLM's flag of the same name; on by default, as in vLLM).
    #[arg(long)]
    no_enable_prefix_caching: bool,
    /// Tokens per KV block (vLLM's flag; 16 as on GPUs).
    #[arg(long, default_value_t = switchyard::sim::BLOCK_SIZE)]
    block_size: u32,
}

impl SimArgs {
    fn config(&self) -> Result<SimConfig, clap::Error> {
        let (profile, timing) = match self.profile {
            ProfileArg::Fixed => (
                Profile::default(),
                Timing::fixed_ms(
                    self.ttft_ms.unwrap_or(Timing::FIXED_TTFT_MS),
                    self.itl_ms.unwrap_or(Timing::FIXED_ITL_MS),
                ),
            ),
            ProfileArg::Modeled(profile) => {
                if self.ttft_ms.is_some() || self.itl_ms.is_some() {
                    return Err(clap::Error::raw(
                        clap::error::ErrorKind::ArgumentConflict,
                        format!(
                            "--ttft-ms and --itl-ms need --profile fixed (profile {profile} \
                             times tokens from its batching model)\n"
                        ),
                    ));
                }
                (profile, Timing::Modeled)
            }
        };
        Ok(SimConfig {
            model: self.model.clone(),
            profile,
            timing,
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
            embedding_model: self.embedding_model.clone(),
            enable_prompt_tokens_details: self.enable_prompt_tokens_details,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            block_size: self.block_size,
        })
    }
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// Address of the server; the simulated engines take free loopback ports.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Simulated nodes per model alias.
    #[arg(long, default_value = "small=2,medium=1,large=1")]
    nodes: String,
    /// Divide every engine delay by this factor.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Server replicas, on consecutive ports from `--listen`. More than one needs PostgreSQL
    /// (`DATABASE_URL`, default database switchyard_demo on 127.0.0.1:5432) and Redis
    /// (`REDIS_URL`, default redis://127.0.0.1:6379); nodes are spread over the replicas.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let dir = PathBuf::from(".switchyard");
    std::fs::create_dir_all(&dir).context("creating .switchyard/")?;
    let mut server = Config::load(None)?;
    server.listen = args.listen;
    let mut database_url = demo::demo_database_url(&dir);
    if args.replicas > 1 {
        // A cluster shares PostgreSQL and Redis: the ones the environment names, or the
        // local ones.
        database_url = demo::cluster_database_url().await?;
        server.redis_url = Some(
            std::env::var(switchyard::env_names::REDIS_URL)
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
        );
        server.redis_prefix = "switchyard-demo:".into();
    }
    let config = FleetConfig {
        server,
        nodes: demo::parse_nodes(&args.nodes)?,
        time_scale: args.time_scale,
        replicas: args.replicas.max(1),
        ..FleetConfig::default()
    };
    let fleet = Fleet::start(config, &database_url).await.context(
        "starting the demo (several replicas need PostgreSQL and Redis: see docs/runbooks.md, Running several replicas)",
    )?;
    let env_file = demo::write_env_file(&dir, &fleet)?;
    println!("{}", demo::banner(&fleet, &env_file));
    shutdown_signal().await;
    eprintln!("draining…");
    fleet.shutdown(Duration::from_secs(30)).await;
    Ok(())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = Config::load(args.config.as_deref())?;
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    let store = store::connect_store(&config.database_url).await?;
    if !args.no_migrate {
        store.migrate().await?;
    }
    let coordinator: Arc<dyn Coordinator> = match (&config.redis_url, &config.redis_ca_file) {
        (Some(url), Some(ca)) => Arc::new(
            RedisCoordinator::connect_tls(
                url,
                &config.redis_prefix,
                RedisCoordinatorOptions::default(),
                Some(ca),
            )
            .await?,
        ),
        (url, _) => coord::connect_coordinator(url.as_deref(), &config.redis_prefix).await?,
    };
    let server = Server::bind(config, store, coordinator).await?;
    shutdown_signal().await;
    server.shutdown(Duration::from_secs(30)).await;
    Ok(())
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let config = Config::load(args.config.as_deref())?;
    store::connect_store(&config.database_url)
        .await?
        .migrate()
        .await?;
    println!("migrations applied");
    Ok(())
}

async fn node(args: NodeArgs) -> anyhow::Result<()> {
    let token = match (args.token, args.token_file) {
        (Some(_), Some(_)) => anyhow::bail!(
            "both a node token (--token or SWITCHYARD_NODE_TOKEN) and --token-file are given; \
             give one"
        ),
        (None, None) => anyhow::bail!(
            "no node token: give --token-file PATH, --token TOKEN or SWITCHYARD_NODE_TOKEN"
        ),
        (Some(token), None) => NodeToken::Value(token),
        (None, Some(path)) => NodeToken::File(path),
    };
    let mut config = AgentConfig::new(args.server, args.node_id, String::new(), args.engine);
    config.token = token;
    config.location = args.location;
    config.ca_file = args.ca_file;
    config.gpus = node_agent::gpus(args.gpus, &args.gpu_name, args.gpu_memory_mib);
    config.drain_timeout = args.drain_timeout;
    config.engine_priority = args.engine_priority;
    if args.gpus == 0 {
        tracing::warn!(
            "no --gpus: the node registers no GPUs and the cost report counts no GPU hours for it"
        );
    }
    let drain = config.drain.clone();
    let stop = CancellationToken::new();
    let mut agent = tokio::spawn(node_agent::run(config, stop.clone()));
    let mut signals = Signals::new();
    tokio::select! {
        ended = &mut agent => return Ok(ended??),
        () = signals.next() => {}
    }
    // The first signal drains: the server gives the node no new work, what runs may finish
    // within --drain-timeout, then the agent closes and exits 0.
    tracing::info!("signal received: draining (a second signal stops at once)");
    drain.cancel();
    tokio::select! {
        ended = &mut agent => ended??,
        () = signals.next() => {
            tracing::warn!("second signal: stopping now");
            stop.cancel();
            agent.await??;
            anyhow::bail!("stopped by a second signal before the drain finished");
        }
    }
    Ok(())
}

/// SIGTERM and SIGINT, each delivered once per signal, for as long as it lives (a listener
/// made anew for every wait could miss a signal between two waits).
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Self {
                term: signal(SignalKind::terminate()).ok(),
                int: signal(SignalKind::interrupt()).ok(),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// The next SIGTERM or SIGINT (Ctrl-C elsewhere).
    async fn next(&mut self) {
        #[cfg(unix)]
        {
            async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(s) => {
                        if s.recv().await.is_none() {
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            tokio::select! {
                () = recv(&mut self.term) => {}
                () = recv(&mut self.int) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn sim(args: SimArgs) -> anyhow::Result<()> {
    let config = match args.config() {
        Ok(config) => config,
        Err(e) => e.exit(),
    };
    let server = SimServer::bind(config, args.listen)
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

/// Logs to stderr (JSON with `SWITCHYARD_LOG_FORMAT=json`) and, with an OTLP endpoint,
/// spans to the collector; the returned exporter is flushed at exit.
fn init_tracing(
    otlp_endpoint: Option<&str>,
) -> anyhow::Result<Option<switchyard::telemetry::Otel>> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = switchyard::telemetry::filter(&std::env::var("RUST_LOG").unwrap_or_default());
    let json = std::env::var(switchyard::env_names::LOG_FORMAT).is_ok_and(|v| v == "json");
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let fmt = if json {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    };
    let (otel_layer, otel) = match otlp_endpoint {
        Some(endpoint) => {
            let (layer, otel) = switchyard::telemetry::otlp_layer(endpoint)?;
            (Some(layer), Some(otel))
        }
        None => (None, None),
    };
    tracing_subscriber::registry()
        .with(otel_layer)
        .with(fmt)
        .with(filter)
        .init();
    Ok(otel)
}

/// The OTLP endpoint: the server's configuration (file, then environment); for the other
/// commands, the environment alone.
fn otlp_endpoint(command: &Command) -> Option<String> {
    match command {
        // A configuration that does not load is reported by `serve` itself.
        Command::Serve(args) => Config::load(args.config.as_deref())
            .ok()
            .and_then(|c| c.telemetry.otlp_endpoint),
        _ => std::env::var(switchyard::env_names::OTLP_ENDPOINT)
            .ok()
            .filter(|v| !v.is_empty()),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before anything can open a TLS connection: aws-lc-rs, whatever else is compiled in.
    switchyard::tls::install_provider();
    let cli = Cli::parse();
    let otel = init_tracing(otlp_endpoint(&cli.command).as_deref())?;
    let result = match cli.command {
        Command::Demo(args) => demo(args).await,
        Command::Serve(args) => serve(args).await,
        Command::Node(args) => node(args).await,
        Command::Sim(args) => sim(args).await,
        Command::Migrate(args) => migrate(args).await,
    };
    if let Some(otel) = otel {
        // Blocking: the exporter sends what is queued before the process ends.
        let _ = tokio::task::spawn_blocking(move || otel.shutdown()).await;
    }
    result
}
