//! `kvmesh stat --admin HOST:PORT [--watch [SECS]] [-o table|json]`:
//! one table of the fleet from any sidecar's admin port. A single run takes
//! two samples `--window` apart (rates need two); `--watch` redraws every
//! SECS until Ctrl-C, with rates between consecutive samples.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::fetch::{fetch, FetchError};
use super::table::{render, table, Sample, Table};

/// Arguments of `stat`.
#[derive(Debug, Clone, Args)]
pub struct StatArgs {
    /// The admin port of any sidecar in the mesh, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub admin: String,
    /// Redraw every SECS seconds (default 2) until Ctrl-C.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2", value_parser = parse_secs)]
    pub watch: Option<Duration>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Seconds between the two samples a single run takes its rates from.
    #[arg(long, value_name = "SECS", default_value = "1", value_parser = parse_secs)]
    pub window: Duration,
    /// Deadline of one request to the admin port, in seconds.
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = parse_secs)]
    pub timeout: Duration,
}

/// How `stat` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 86400]")),
    }
}

/// One sample of the admin port at `addr`.
pub async fn sample(addr: &str, deadline: Duration) -> Result<Sample, FetchError> {
    let report = fetch(addr, deadline).await?;
    Ok(Sample {
        report,
        at: tokio::time::Instant::now(),
    })
}

/// A single run's table: two samples `window` apart.
pub async fn once(addr: &str, window: Duration, deadline: Duration) -> Result<Table, FetchError> {
    let first = sample(addr, deadline).await?;
    tokio::time::sleep(window).await;
    let second = sample(addr, deadline).await?;
    Ok(table(addr, Some(&first), &second))
}

/// The table in the chosen format, ending with a newline.
pub fn format(t: &Table, output: Output) -> String {
    match output {
        Output::Table => render(t),
        Output::Json => {
            let mut s = serde_json::to_string_pretty(t)
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
            s.push('\n');
            s
        }
    }
}

/// Runs `stat`; the exit code is 1 when the admin port cannot answer.
pub fn main(args: &StatArgs) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvmesh stat: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        match args.watch {
            None => match once(&args.admin, args.window, args.timeout).await {
                Ok(t) => {
                    print!("{}", format(&t, args.output));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("kvmesh stat: {e}");
                    ExitCode::FAILURE
                }
            },
            Some(every) => {
                tokio::select! {
                    () = watch(args, every) => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                ExitCode::SUCCESS
            }
        }
    })
}

/// Redraws until cancelled; an unreachable port is shown and retried.
async fn watch(args: &StatArgs, every: Duration) {
    let mut prev: Option<Sample> = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let text = match sample(&args.admin, args.timeout).await {
            Ok(cur) => {
                let t = table(&args.admin, prev.as_ref(), &cur);
                prev = Some(cur);
                format(&t, args.output)
            }
            Err(e) => format!("kvmesh stat: {e}\n"),
        };
        let mut out = std::io::stdout().lock();
        // JSON is for scripts: one document per refresh, no screen control.
        let _ = match args.output {
            Output::Table => write!(
                out,
                "\x1b[2J\x1b[Hkvmesh stat {} (every {:?}, Ctrl-C to stop)\n\n{text}",
                args.admin, every
            ),
            Output::Json => write!(out, "{text}"),
        };
        let _ = out.flush();
    }
}
