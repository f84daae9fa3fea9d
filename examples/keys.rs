//! A key's life on demand, over PostgreSQL: what support asks ("what happened to key
//! X?") and what frees a key a bug left running.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres \
//!     cargo run --example keys -- [--schema NAME] [--table NAME] COMMAND
//!
//!   show SCOPE KEY                        the key's record: state, holder's token, lease
//!                                         left, status, sizes, when claimed, completed, kept
//!   running --older-than SECS [--limit N] keys running for at least SECS, oldest first
//!                                         (100 at most by default)
//!   release SCOPE KEY [--token N]         frees a running key: its holder can store
//!                                         nothing more, and a retry runs it anew; with
//!                                         --token, only if that token still holds it
//!   delete SCOPE KEY                      deletes a completed key: a retry runs again
//! ```
//!
//! SCOPE is the scope as the layer keys it: `principal:<name>` for the keys of a
//! principal (`Principal::new("<name>")`, what the app's authentication names),
//! `''` for the anonymous scope, `auth:<hash>` for the `Authorization` fallback; the
//! `running` list prints them. `--schema` and `--table` name the store's table
//! (default `public.idempotency_keys`).
//!
//! Each action is logged at `info` (on stderr) with the hashes of the key and its scope,
//! as the layer's own logs name them, never in clear. Exit status: 0 when the action
//! was done (or the key found), 1 when there was nothing to do (no such key, a key in
//! another state), 2 for a usage error, 3 when the store failed.

use std::{
    process::ExitCode,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tower_idempotency::{
    Scope, StoredResponse,
    store::{FencingToken, KeyRecord, KeyState, Operator, PostgresStore, Removal},
};

const USAGE: &str = "usage: keys [--schema NAME] [--table NAME] COMMAND
  show SCOPE KEY
  running --older-than SECS [--limit N]
  release SCOPE KEY [--token N]
  delete SCOPE KEY
SCOPE: principal:<name> for a principal's keys, '' for the anonymous scope";

type Error = Box<dyn std::error::Error + Send + Sync>;

/// What the command line asks for.
enum Command {
    Show(Scope, String),
    Running { older_than: Duration, limit: usize },
    Release(Scope, String, Option<FencingToken>),
    Delete(Scope, String),
}

struct Args {
    schema: Option<String>,
    table: Option<String>,
    command: Command,
}

fn parse(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut args = args.into_iter();
    let (mut schema, mut table, mut older_than, mut limit, mut token) =
        (None, None, None, None, None);
    let mut words = Vec::new();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--schema" => schema = Some(value("--schema")?),
            "--table" => table = Some(value("--table")?),
            "--older-than" => {
                let secs: f64 = number(&value("--older-than")?, "--older-than")?;
                older_than = Some(
                    Duration::try_from_secs_f64(secs)
                        .map_err(|_| "--older-than takes seconds, at least 0".to_owned())?,
                );
            }
            "--limit" => limit = Some(number(&value("--limit")?, "--limit")?),
            "--token" => token = Some(FencingToken::new(number(&value("--token")?, "--token")?)),
            "-h" | "--help" => return Err(String::new()),
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}")),
            _ => words.push(arg),
        }
    }
    let key = |scope: &String, key: &String| (Scope::new(scope.as_str()), key.clone());
    let command = match words.as_slice() {
        [c, s, k] if c == "show" => {
            let (scope, key) = key(s, k);
            Command::Show(scope, key)
        }
        [c] if c == "running" => Command::Running {
            older_than: older_than.ok_or("running needs --older-than SECS")?,
            limit: limit.unwrap_or(100),
        },
        [c, s, k] if c == "release" => {
            let (scope, key) = key(s, k);
            Command::Release(scope, key, token)
        }
        [c, s, k] if c == "delete" => {
            let (scope, key) = key(s, k);
            Command::Delete(scope, key)
        }
        _ => return Err("expected a command and its arguments".into()),
    };
    Ok(Args {
        schema,
        table,
        command,
    })
}

fn number<T: std::str::FromStr>(text: &str, flag: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{flag} takes a number, not {text:?}"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(why) => {
            if !why.is_empty() {
                eprintln!("keys: {why}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("keys: {e}");
            ExitCode::from(3)
        }
    }
}

/// Runs the command; `false` when there was nothing to do.
async fn run(args: Args) -> Result<bool, Error> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let mut store = PostgresStore::connect(&url)?;
    if let Some(schema) = &args.schema {
        store = store.with_schema_name(schema)?;
    }
    if let Some(table) = &args.table {
        store = store.with_table_name(table)?;
    }
    let operator = Operator::new(store);
    match args.command {
        Command::Show(scope, key) => {
            let record = operator.look_up(&scope, &key).await?;
            print_hashes(&scope, &key);
            match record {
                Some(record) => print_record(&record),
                None => println!("no record (never claimed, released, or purged)"),
            }
            Ok(true)
        }
        Command::Running { older_than, limit } => {
            let keys = operator.running(older_than, limit).await?;
            println!(
                "{} running for {} s or more",
                keys.len(),
                older_than.as_secs_f64()
            );
            for running in &keys {
                let KeyState::Running { lease_left } = running.record.state else {
                    continue;
                };
                println!(
                    "{:?} {:?} token {} claimed {} lease left {:.1} s",
                    running.scope.as_str(),
                    running.key,
                    running.record.token,
                    when(running.record.claimed_at),
                    lease_left.as_secs_f64(),
                );
            }
            Ok(true)
        }
        Command::Release(scope, key, holder) => {
            let released = operator.release(&scope, &key, holder).await?;
            print_hashes(&scope, &key);
            Ok(print_removal(&released, "released"))
        }
        Command::Delete(scope, key) => {
            let deleted = operator.delete(&scope, &key).await?;
            print_hashes(&scope, &key);
            Ok(print_removal(&deleted, "deleted"))
        }
    }
}

fn print_hashes(scope: &Scope, key: &str) {
    println!(
        "key hash {} scope hash {}",
        Operator::hash(key),
        Operator::hash(scope.as_str())
    );
}

fn print_record(record: &KeyRecord) {
    println!("token {}", record.token);
    match &record.state {
        KeyState::Running { lease_left } => {
            println!(
                "state running, lease left {:.1} s",
                lease_left.as_secs_f64()
            );
        }
        KeyState::Completed { response } => {
            println!("state completed, status {}", response.status.as_u16());
            let headers = StoredResponse::encode_headers(&response.headers).len();
            println!(
                "stored headers {} ({headers} bytes), body {} bytes",
                response.headers.len(),
                response.body.len()
            );
        }
        KeyState::Remembered { status } => println!(
            "state remembered (its response expired and is gone; a retry gets 410), status {}",
            status.as_u16()
        ),
        _ => println!("state {:?}", record.state),
    }
    println!("claimed {}", when(record.claimed_at));
    if record.completed_at.is_some() {
        println!("completed {}", when(record.completed_at));
    }
    println!("kept {:.1} s more", record.expires_in.as_secs_f64());
}

/// Prints what a release or deletion did; whether it did it.
fn print_removal(removal: &Removal, done: &str) -> bool {
    match removal {
        Removal::Removed { token } => {
            println!("{done} (token {token}): a retry with the key runs anew");
            true
        }
        Removal::Absent => {
            println!("no record: nothing to do");
            false
        }
        Removal::Refused(record) => {
            println!("not {done}: the key is not in the state this action is for");
            print_record(record);
            false
        }
        _ => false,
    }
}

/// `at` as an RFC 3339 time in UTC, to the millisecond.
fn when(at: Option<SystemTime>) -> String {
    let Some(since) = at.and_then(|at| at.duration_since(UNIX_EPOCH).ok()) else {
        return "unknown".into();
    };
    let (days, secs) = (since.as_secs() / 86_400, since.as_secs() % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        since.subsec_millis()
    )
}
