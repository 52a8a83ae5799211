//! The command line: clap subcommands, each a thin call into the modules that do the work.
//! Exit codes: 0 ok, 1 failure, 2 usage error (clap's own).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{self, Format};
use crate::topology::{self, PlanFormat};

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "Declarative message pipelines: YAML in, RabbitMQ topology and workers out"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check pipeline files; exit 1 on any error (warnings alone exit 0).
    Validate {
        /// Files or directories (searched recursively for *.yaml and *.yml).
        #[arg(default_value = "pipelines")]
        paths: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Print the broker topology the files declare, without connecting to a broker.
    Plan {
        #[arg(default_value = "pipelines")]
        paths: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
        format: PlanFormat,
    },
    /// Print the JSON Schema of pipeline files.
    Schema,
}

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { paths, format } => validate(&paths, format),
        Command::Plan { paths, format } => {
            let Some(config) = load_or_report(&paths) else {
                return ExitCode::FAILURE;
            };
            print!("{}", topology::render(&topology::plan(&config), format));
            ExitCode::SUCCESS
        }
        Command::Schema => {
            print!("{}", config::schema::TEXT);
            ExitCode::SUCCESS
        }
    }
}

fn validate(paths: &[PathBuf], format: Format) -> ExitCode {
    let validation = config::load(paths);
    let text = config::diagnostic::render(&validation.diagnostics, format, &|p| std::fs::read_to_string(p).ok());
    if format == Format::Json || !text.is_empty() {
        print!("{text}");
    }
    if validation.has_errors() {
        ExitCode::FAILURE
    } else {
        if format == Format::Human {
            let queues = validation.config.as_ref().map_or(0, |c| c.queues.len());
            eprintln!("ok: {queues} queue(s) valid");
        }
        ExitCode::SUCCESS
    }
}

/// Loads the config for commands that need a valid one; problems go to stderr.
fn load_or_report(paths: &[PathBuf]) -> Option<config::Config> {
    let validation = config::load(paths);
    let text = config::diagnostic::render(&validation.diagnostics, Format::Human, &|p| std::fs::read_to_string(p).ok());
    eprint!("{text}");
    validation.config
}
