//! Lists that are copied by hand across the tree, checked against each other, so that a copy
//! that drifts fails here instead of silently. Each failure names the two files and the entries
//! that differ. Every parser fails loudly when it finds nothing, so a moved or renamed file
//! cannot make a check pass vacuously: update the path or the parser here instead.
//!
//! - **dtypes** (`dtypes`). Reference: the WIT `enum dtype` (`wit/device.wit`). `DTYPES` below
//!   has one row per WIT dtype, in WIT order, saying how every copy spells it: XLA name and
//!   `xla_data.proto` number (`crates/pjrt`, `session.proto`, the session API, the Python
//!   client), element bytes, MLIR type, `.npy` descr (`crates/core/src/npy.rs`), NumPy dtype
//!   (`python/tpubox/_dtypes.py`), safetensors name (`crates/core/src/weights.rs`) and Open
//!   Inference Protocol datatype (`crates/serve/src/protocol.rs`, `wit/model.wit`, the guest
//!   SDK). To add a dtype: add it to the WIT enum, add its row to `DTYPES` (`None` in a column,
//!   with a comment saying why, where that copy cannot hold it), then run this test and fix
//!   each copy it names.
//! - **error kinds** (`error_kinds`). Reference: the WIT `enum error-kind`. Copies: the host's
//!   `ErrorKind` and its WIT conversion, the guest SDK, the session API's `tpubox-error-kind`
//!   trailer and gRPC codes, `session.proto`'s comment, the Python client's exception classes,
//!   the C template and example, `docs/WIT.md`, `docs/NOTEBOOKS.md`, the serve error mapping.
//!   Kinds that exist outside WIT are listed in `SESSION_KINDS` and `CLIENT_KINDS`, each with
//!   its reason. To add a kind: add it to the WIT enum, then run this test and fix each copy it
//!   names.
//! - **tenant limits** (`tenant_limits`). Reference: the fields of `TenantLimits`
//!   (`crates/core/src/tenant.rs`). `LIMITS` below has one row per field (and one per session-
//!   only limit) saying how each copy names it: the kebab-case name errors use, the session API's
//!   wire name (`session.proto` `Limits`, `RequestedLimits`, the Python `Limits`), the tokens
//!   file's `[tenant.session]` key, the model config's `[tpubox.limits]` key, the `tpubox run`
//!   flag; `None` where a copy deliberately lacks it, with the reason. To add a limit: add the
//!   field, add its row to `LIMITS`, then run this test and fix each copy it names.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The workspace root: this test belongs to the package in `host/`.
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// This file, as failure messages name it.
const HERE: &str = "tests/all/lists.rs";

type Map = BTreeMap<String, String>;
type Set = BTreeSet<String>;

// ------------------------------------------------------------------------------------------
// Reading and parsing (std only, text): each parser small and specific to its file's syntax.
// ------------------------------------------------------------------------------------------

/// The text of `path` (from the workspace root).
fn read(path: &str) -> String {
    let full = Path::new(ROOT).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| {
        panic!(
            "{HERE} reads {path} ({}): {e}; if the file moved, update its path in {HERE}",
            full.display()
        )
    })
}

/// `path`'s code: comments removed (`//`, `/* */`), string literals kept, and whitespace before
/// a `.` dropped so that a method chain rustfmt split over lines reads `a.b.c`.
fn read_code(path: &str) -> String {
    strip_comments(&read(path))
}

/// The files under `dir` (recursively) whose names end with `ext`, sorted.
fn files_under(dir: &str, ext: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_string()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(Path::new(ROOT).join(&d))
            .unwrap_or_else(|e| panic!("{HERE} lists {d}: {e}; update the path in {HERE}"));
        for e in entries {
            let name = e.unwrap().file_name().to_string_lossy().to_string();
            let p = format!("{d}/{name}");
            if Path::new(ROOT).join(&p).is_dir() {
                stack.push(p);
            } else if name.ends_with(ext) {
                out.push(p);
            }
        }
    }
    out.sort();
    found(out, dir, &format!("`*{ext}` files"))
}

/// Panics: a parser found nothing where a list must be.
fn none_found(path: &str, what: &str) -> ! {
    panic!(
        "{HERE} found no {what} in {path}: the file moved or its syntax changed; update the \
         parser in {HERE} (a list that cannot be found must not pass)"
    )
}

/// `items`, or a loud failure when there are none.
fn found<T>(items: Vec<T>, path: &str, what: &str) -> Vec<T> {
    if items.is_empty() {
        none_found(path, what)
    }
    items
}

/// `text` without its `//` and `/* */` comments (string and character literals kept), and
/// without the whitespace before a `.` (see `read_code`).
fn strip_comments(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            i += 2;
            while i + 1 < c.len() && !(c[i] == '*' && c[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c[i] == 'r'
            && matches!(next, Some('"') | Some('#'))
            && (i == 0 || !ident(c[i - 1]))
        {
            // A raw string `r#"..."#`: copied as it is.
            let mut j = i + 1;
            let mut hashes = 0;
            while j < c.len() && c[j] == '#' {
                hashes += 1;
                j += 1;
            }
            if c.get(j) != Some(&'"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let rest: String = c[j + 1..].iter().collect();
            let end = rest
                .find(&close)
                .map_or(c.len(), |e| j + 1 + rest[..e].chars().count());
            let stop = (end + 1 + hashes).min(c.len());
            out.extend(&c[i..stop]);
            i = stop;
        } else if c[i] == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' && i + 1 < c.len() {
                    out.push(c[i]);
                    i += 1;
                }
                out.push(c[i]);
                i += 1;
            }
            if i < c.len() {
                out.push('"');
                i += 1;
            }
        } else if c[i] == '\'' && c.get(i + 2) == Some(&'\'') {
            out.extend(&c[i..i + 3]);
            i += 3;
        } else if c[i] == '\'' && next == Some('\\') && c.get(i + 3) == Some(&'\'') {
            out.extend(&c[i..i + 4]);
            i += 4;
        } else if c[i].is_whitespace() {
            let mut j = i;
            while j < c.len() && c[j].is_whitespace() {
                j += 1;
            }
            // `a\n    .b()` reads `a.b()`; `..Default::default()` keeps its dots.
            if c.get(j) == Some(&'.') && c.get(j + 1) != Some(&'.') {
                i = j;
            } else {
                out.extend(&c[i..j]);
                i = j;
            }
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The index just past the bracket that closes the one at `open` (`{`, `[` or `(`), skipping
/// string and character literals.
fn close_of(text: &str, open: usize) -> Option<usize> {
    let b = text.as_bytes();
    let (o, c) = match b[open] {
        b'{' => (b'{', b'}'),
        b'[' => (b'[', b']'),
        b'(' => (b'(', b')'),
        _ => return None,
    };
    let mut depth = 0usize;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') => i += 2,
            b'\'' if b.get(i + 1) == Some(&b'\\') && b.get(i + 3) == Some(&b'\'') => i += 3,
            x if x == o => depth += 1,
            x if x == c => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The text inside the first `{ ... }` (or `[ ... ]` when `bracket` is `[`) that opens after
/// the first `marker` in `text`; fails loudly when there is none.
fn block_of<'a>(text: &'a str, marker: &str, bracket: char, path: &str) -> &'a str {
    let Some(at) = text.find(marker) else {
        none_found(path, &format!("`{marker}`"))
    };
    let from = at + marker.trim_end_matches(bracket).len();
    let Some(open) = text[from..].find(bracket).map(|o| from + o) else {
        none_found(path, &format!("`{bracket}` after `{marker}`"))
    };
    let Some(close) = close_of(text, open) else {
        none_found(path, &format!("the end of `{marker}`"))
    };
    &text[open + 1..close - 1]
}

/// `block_of(text, marker, '{', path)`.
fn block<'a>(text: &'a str, marker: &str, path: &str) -> &'a str {
    block_of(text, marker, '{', path)
}

/// `s` split at the `sep`s outside brackets (and outside `<...>` when `angles`, for types).
fn split_top(s: &str, sep: char, angles: bool) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut angle) = (0i32, 0i32);
    let mut cur = String::new();
    let mut in_str = false;
    let mut prev = ' ';
    for ch in s.chars() {
        if in_str {
            if ch == '"' && prev != '\\' {
                in_str = false;
            }
        } else {
            match ch {
                '"' => in_str = true,
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => depth -= 1,
                '<' if angles && depth == 0 => angle += 1,
                '>' if angles && depth == 0 && prev != '-' && prev != '=' => angle -= 1,
                c if c == sep && depth == 0 && angle == 0 => {
                    out.push(std::mem::take(&mut cur));
                    prev = ch;
                    continue;
                }
                _ => {}
            }
        }
        cur.push(ch);
        prev = ch;
    }
    out.push(cur);
    out.into_iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

/// The leading identifier of `s`.
fn ident(s: &str) -> String {
    s.trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// `s` without `prefix`, read as one name, string literal (its content) or number; `None` when
/// `s` does not start with `prefix` or nothing follows it.
fn atom(s: &str, prefix: &str) -> Option<String> {
    let s = s.trim().strip_prefix(prefix)?;
    if let Some(q) = s.strip_prefix('"') {
        return q.find('"').map(|e| q[..e].to_string());
    }
    let w = ident(s);
    (!w.is_empty()).then_some(w)
}

/// The arms `PAT | PAT => RESULT` of the `match`es in `code`: each pattern with the result's
/// text (up to the first `,` or line end).
fn arms(code: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("=>") {
        let before = &code[..i];
        let from = before.rfind([',', '{', '}']).map_or(0, |j| j + 1);
        let rest = &code[i + 2..];
        let rhs = rest[..rest.find([',', '\n']).unwrap_or(rest.len())].trim();
        for pat in before[from..].split('|') {
            if !pat.trim().is_empty() {
                out.push((pat.trim().to_string(), rhs.to_string()));
            }
        }
    }
    out
}

/// The arms of `code` whose pattern is `lhs` + an atom, as (atom, result atom after `rhs`);
/// the result is `None` when it is not `rhs` + an atom (`return None`, a block).
fn pairs(code: &str, lhs: &str, rhs: &str) -> Vec<(String, Option<String>)> {
    arms(code)
        .into_iter()
        .filter_map(|(p, r)| {
            let none = r.starts_with("return") || r == "None";
            Some((atom(&p, lhs)?, if none { None } else { atom(&r, rhs) }))
        })
        .filter(|(p, _)| p != "_")
        .collect()
}

/// The variants of a Rust enum body.
fn rust_variants(body: &str) -> Vec<String> {
    split_top(body, ',', false)
        .iter()
        .map(|v| {
            let v = v
                .lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .collect::<Vec<_>>()
                .join(" ");
            ident(&v)
        })
        .filter(|v| !v.is_empty())
        .collect()
}

/// A field of a struct definition: its name and the attributes before it.
struct Field {
    name: String,
    attrs: String,
}

/// The fields of a Rust struct body (`pub name: Type,` with `#[...]` attributes).
fn rust_fields(body: &str) -> Vec<Field> {
    split_top(body, ',', true)
        .iter()
        .filter_map(|f| {
            let mut attrs = String::new();
            let mut rest = f.trim();
            while rest.starts_with("#[") {
                let end = close_of(rest, 1)?;
                attrs.push_str(&rest[..end]);
                rest = rest[end..].trim_start();
            }
            let rest = rest.strip_prefix("pub ").unwrap_or(rest);
            let (name, _) = rest.split_once(':')?;
            Some(Field {
                name: name.trim().to_string(),
                attrs,
            })
        })
        .collect()
}

/// The `name: expr` fields of a struct literal body (`..base` and shorthand fields included,
/// the latter with the name as the expression).
fn literal_fields(body: &str) -> Vec<(String, String)> {
    split_top(body, ',', false)
        .iter()
        .filter(|f| !f.starts_with(".."))
        .map(|f| {
            let b = f.as_bytes();
            let colon = (0..b.len()).find(|&i| {
                b[i] == b':' && b.get(i + 1) != Some(&b':') && (i == 0 || b[i - 1] != b':')
            });
            match colon {
                Some(i) => (f[..i].trim().to_string(), f[i + 1..].trim().to_string()),
                None => (f.clone(), f.clone()),
            }
        })
        .collect()
}

/// The items of a `[A, B, C]` constant after `marker`, each as its last path segment.
fn const_array(code: &str, marker: &str, path: &str) -> Vec<String> {
    let Some(at) = code.find(marker) else {
        none_found(path, &format!("`{marker}`"))
    };
    let after_eq = at + code[at..].find('=').unwrap_or(0);
    let items = block_of(&code[after_eq..], "=", '[', path);
    let out = split_top(items, ',', false)
        .iter()
        .map(|s| s.rsplit("::").next().unwrap_or(s).trim().to_string())
        .collect();
    found(out, path, &format!("items of `{marker}`"))
}

/// Every `prefix` + identifier in `code` (the prefix not preceded by an identifier character),
/// with its position.
fn uses(code: &str, prefix: &str) -> Vec<(usize, String)> {
    code.match_indices(prefix)
        .filter(|(i, _)| {
            !code[..*i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.')
        })
        .map(|(i, _)| (i, ident(&code[i + prefix.len()..])))
        .filter(|(_, w)| !w.is_empty())
        .collect()
}

/// The entries of the WIT `enum NAME { ... }` (`%` escapes removed) and the file in `wit/`
/// that declares it.
fn wit_enum(name: &str) -> (String, Vec<String>) {
    let marker = format!("enum {name} {{");
    let mut hits = Vec::new();
    for path in files_under("wit", ".wit") {
        let code = read_code(&path);
        if code.contains(&marker) {
            let body = block(&code, &format!("enum {name} "), &path);
            let entries = split_top(body, ',', false)
                .iter()
                .map(|e| e.trim_start_matches('%').to_string())
                .collect();
            hits.push((
                path.clone(),
                found(entries, &path, &format!("entries of `{marker}`")),
            ));
        }
    }
    match hits.len() {
        1 => hits.pop().unwrap(),
        0 => none_found("wit/*.wit", &format!("`{marker}`")),
        _ => panic!("{HERE}: more than one WIT file declares `{marker}`: {hits:?}"),
    }
}

/// `(name, number)` of each `NAME = N;` in a proto enum body.
fn proto_enum(body: &str) -> Vec<(String, i64)> {
    body.split(';')
        .filter_map(|e| {
            let (n, v) = e.split_once('=')?;
            Some((n.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// `(type, name)` of each `[optional|repeated] TYPE name = N;` in a proto message body.
fn proto_fields(body: &str) -> Vec<(String, String)> {
    body.split(';')
        .filter_map(|f| {
            let (decl, _) = f.split_once('=')?;
            let words: Vec<&str> = decl
                .split_whitespace()
                .filter(|w| !matches!(*w, "optional" | "repeated"))
                .collect();
            match words[..] {
                [ty, name] => Some((ty.to_string(), name.to_string())),
                _ => None,
            }
        })
        .collect()
}

/// The backticked spans of `text` (`` `x` ``; doubled backticks, as reStructuredText writes
/// them, count as one).
fn backticked(text: &str) -> Vec<String> {
    text.replace("``", "`")
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The `"..."` string literals of `text`, in order.
fn quoted(text: &str) -> Vec<String> {
    text.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The text of `text` from the end of `start` to the next `end` (exclusive).
fn between<'a>(text: &'a str, start: &str, end: &str, path: &str) -> &'a str {
    let Some(a) = text.find(start) else {
        none_found(path, &format!("`{start}`"))
    };
    let rest = &text[a + start.len()..];
    let Some(b) = rest.find(end) else {
        none_found(path, &format!("`{end}` after `{start}`"))
    };
    &rest[..b]
}

/// The kebab-case limit names (`max-…`) mentioned in `text`.
fn kebab_limit_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("max-") {
        let before = text[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_') {
            continue;
        }
        let w: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        let w = w.trim_end_matches('-');
        if w.len() > "max-".len() {
            out.insert(w.to_string());
        }
    }
    out
}

/// The rows of the Markdown table whose header line contains `header`: cells, trimmed.
fn md_table(text: &str, header: &str, path: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = text.lines().collect();
    let Some(h) = lines
        .iter()
        .position(|l| l.trim_start().starts_with('|') && l.contains(header))
    else {
        none_found(path, &format!("a table with header `{header}`"))
    };
    let rows = lines[h + 1..]
        .iter()
        .take_while(|l| l.trim_start().starts_with('|'))
        .filter(|l| !l.trim_start().starts_with("|-") && !l.trim_start().starts_with("| -"))
        .map(|l| {
            let cells: Vec<String> = l.trim().split('|').map(|c| c.trim().to_string()).collect();
            cells[1..cells.len().saturating_sub(1)].to_vec()
        })
        .collect();
    found(rows, path, &format!("rows of the table `{header}`"))
}

/// The keys of every `[TABLE]` TOML example in the code blocks of a Markdown file.
fn md_toml_keys(text: &str, table: &str, path: &str) -> Vec<BTreeSet<String>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if l.split('#').next().unwrap_or("").trim() != format!("[{table}]") {
            continue;
        }
        let keys = lines[i + 1..]
            .iter()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .take_while(|l| !l.is_empty() && !l.starts_with('[') && !l.starts_with("```"))
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim().to_string()))
            .collect();
        out.push(keys);
    }
    found(out, path, &format!("`[{table}]` TOML examples"))
}

/// `Python`'s `class NAME(BASE):` bodies: (name, base, body lines).
fn py_classes(text: &str) -> Vec<(String, String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(decl) = l.strip_prefix("class ") else {
            continue;
        };
        let name = ident(decl);
        let base = decl
            .split_once('(')
            .map(|(_, b)| b.split(')').next().unwrap_or("").trim().to_string())
            .unwrap_or_default();
        let body = lines[i + 1..]
            .iter()
            .take_while(|l| l.is_empty() || l.starts_with(' '))
            .copied()
            .collect::<Vec<_>>()
            .join("\n");
        out.push((name, base, body));
    }
    out
}

/// The strings of a Python list assigned to `name` (`name = [ "A", "B" ]`).
fn py_str_list(text: &str, name: &str, path: &str) -> Vec<String> {
    let items = block_of(text, &format!("{name} = "), '[', path);
    found(quoted(items), path, &format!("strings of `{name}`"))
}

/// `invalid-argument` → `InvalidArgument`; `bf16` → `Bf16`; `FP32` → `Fp32`.
fn camel(s: &str) -> String {
    s.to_lowercase()
        .split(['-', '_'])
        .map(|p| {
            let mut c = p.chars();
            c.next()
                .map_or(String::new(), |f| f.to_uppercase().chain(c).collect())
        })
        .collect()
}

/// `InvalidArgument` → `INVALID_ARGUMENT`.
fn screaming_of_camel(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(c.to_uppercase());
    }
    out
}

/// `8 << 30`, `10_000`, `300.0`, `64 MiB`, `Some(Duration::from_secs(300))` as a number;
/// `Ok(None)` for `None`/`none`; `Err` for anything else.
fn number(expr: &str) -> Result<Option<f64>, String> {
    let mut e = expr.trim().replace(['_', ' '], "");
    if e.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    // `Some(X)`, `Duration::from_secs(X)`: X.
    while e.ends_with(')') {
        let Some(open) = e.find('(') else { break };
        if !e[..open]
            .chars()
            .all(|c| c.is_alphanumeric() || c == '_' || c == ':')
        {
            break;
        }
        e = e[open + 1..e.len() - 1].to_string();
    }
    let (e, unit) = match e.strip_suffix("MiB") {
        Some(n) => (n.to_string(), (1u64 << 20) as f64),
        None => (e, 1.0),
    };
    let v = match e.split_once("<<") {
        Some((a, b)) => {
            let (a, b) = (a.parse::<u64>(), b.parse::<u32>());
            match (a, b) {
                (Ok(a), Ok(b)) => Some((a << b) as f64),
                _ => None,
            }
        }
        None => e.parse::<f64>().ok(),
    };
    v.map(|v| Some(v * unit)).ok_or_else(|| expr.to_string())
}

/// A source file of the tree: its path and its code (see `read_code`).
struct Src {
    path: String,
    code: String,
}

impl Src {
    fn new(path: &str) -> Src {
        Src {
            path: path.to_string(),
            code: read_code(path),
        }
    }

    /// How messages name the item `marker` finds here: `` PATH `byte_size` ``.
    fn label(&self, marker: &str) -> String {
        let item = marker
            .trim_start_matches("pub ")
            .trim_start_matches("const ")
            .trim_start_matches("fn ");
        let item = item
            .split('(')
            .next()
            .unwrap_or(item)
            .trim_end_matches(['{', ' ', '=']);
        format!("{} `{item}`", self.path)
    }

    /// The text inside the `{ ... }` after `marker`.
    fn block(&self, marker: &str) -> &str {
        block(&self.code, marker, &self.path)
    }

    /// The arms `lhs`+atom `=>` `rhs`+atom of the item after `marker`, with its label.
    fn arms(&self, marker: &str, lhs: &str, rhs: &str) -> (String, Vec<(String, Option<String>)>) {
        let p = pairs(self.block(marker), lhs, rhs);
        let what = format!("`{lhs}…` match arms in `{marker}`");
        (self.label(marker), found(p, &self.path, &what))
    }

    /// The variants of the enum after `marker`, with its label.
    fn variants(&self, marker: &str) -> (String, Vec<String>) {
        let v = rust_variants(self.block(marker));
        let what = format!("variants of `{marker}`");
        (self.label(marker), found(v, &self.path, &what))
    }

    /// The fields of the struct after `marker`, with its label.
    fn fields(&self, marker: &str) -> (String, Vec<Field>) {
        let f = rust_fields(self.block(marker));
        let what = format!("fields of `{marker}`");
        (self.label(marker), found(f, &self.path, &what))
    }

    /// The fields of the struct literal `TYPE { ... }` in the item after `marker`.
    fn literal(&self, marker: &str, ty: &str) -> Vec<(String, String)> {
        let f = literal_fields(block(self.block(marker), ty, &self.path));
        found(
            f,
            &self.path,
            &format!("fields of the `{ty}` in `{marker}`"),
        )
    }

    /// The items of `TY::ALL` (the file's one `const ALL`), with a label.
    fn all(&self, ty: &str) -> (String, Vec<String>) {
        let label = format!("{} `{ty}::ALL`", self.path);
        (label, const_array(&self.code, "const ALL", &self.path))
    }
}

// ------------------------------------------------------------------------------------------
// Reporting: every disagreement is collected, then the test fails with all of them.
// ------------------------------------------------------------------------------------------

#[derive(Default)]
struct Report {
    problems: RefCell<Vec<String>>,
}

impl Report {
    fn problem(&self, p: String) {
        self.problems.borrow_mut().push(p);
    }

    /// `found` (parsed from `copy`) must map exactly what `expected` (from `reference`) maps.
    fn maps(&self, what: &str, reference: &str, expected: &Map, copy: &str, found: &Map) {
        self.diff(what, reference, expected, copy, found, true);
    }

    /// `found` must hold exactly the entries of `expected`.
    fn sets(&self, what: &str, reference: &str, expected: &Set, copy: &str, found: &Set) {
        let as_map = |s: &Set| s.iter().map(|k| (k.clone(), String::new())).collect();
        self.diff(
            what,
            reference,
            &as_map(expected),
            copy,
            &as_map(found),
            false,
        );
    }

    /// `found` must be `expected`, in the same order.
    fn lists(
        &self,
        what: &str,
        reference: &str,
        expected: &[String],
        copy: &str,
        found: &[String],
    ) {
        let before = self.problems.borrow().len();
        self.sets(what, reference, &set_of(expected), copy, &set_of(found));
        if self.problems.borrow().len() == before && expected != found {
            self.problem(format!(
                "{copy} disagrees with {reference} on the order of {what}:\n    \
                 {reference}: {expected:?}\n    {copy}: {found:?}"
            ));
        }
    }

    fn diff(
        &self,
        what: &str,
        reference: &str,
        expected: &Map,
        copy: &str,
        found: &Map,
        values: bool,
    ) {
        let show = |v: &String| {
            if values {
                format!(" (→ `{v}`)")
            } else {
                String::new()
            }
        };
        let mut lines = Vec::new();
        for (k, v) in expected {
            match found.get(k) {
                None => lines.push(format!(
                    "`{k}`{} is in {reference} but missing from {copy}",
                    show(v)
                )),
                Some(f) if f != v => {
                    lines.push(format!("`{k}`: {reference} says `{v}`, {copy} says `{f}`"))
                }
                Some(_) => {}
            }
        }
        for (k, v) in found.iter().filter(|(k, _)| !expected.contains_key(*k)) {
            lines.push(format!(
                "`{k}`{} is in {copy} but not in {reference}",
                show(v)
            ));
        }
        if !lines.is_empty() {
            let lines = lines.join("\n    ");
            self.problem(format!(
                "{copy} disagrees with {reference} on {what}:\n    {lines}"
            ));
        }
    }

    fn finish(self, list: &str) {
        let problems = self.problems.into_inner();
        if !problems.is_empty() {
            panic!(
                "the {list} copies disagree ({} problem(s)); fix the copy (or, for a deliberate \
                 difference, the expectation in {HERE}, with its reason):\n\n{}\n",
                problems.len(),
                problems.join("\n\n")
            );
        }
    }
}

/// A default as messages show it: `8192`, `none`.
fn shown(v: Option<f64>) -> String {
    v.map_or("none".into(), |v| v.to_string())
}

fn map_of(pairs: impl IntoIterator<Item = (String, String)>) -> Map {
    pairs.into_iter().collect()
}

fn set_of<S: ToString>(items: impl IntoIterator<Item = S>) -> Set {
    items.into_iter().map(|s| s.to_string()).collect()
}

/// What a copy maps an entry to when it maps it to nothing (`return None`).
const NONE: &str = "(none)";

const PJRT_TYPES: &str = "crates/pjrt/src/types.rs";
const WASM_WIT: &str = "crates/wasm/src/wit.rs";
const SESSION_PROTO: &str = "host/proto/tpubox/v1/session.proto";
const SESSION_GRPC: &str = "crates/session-api/src/grpc.rs";
const SESSION_POLICY: &str = "crates/session-api/src/policy.rs";
const CORE_WEIGHTS: &str = "crates/core/src/weights.rs";
const CORE_NPY: &str = "crates/core/src/npy.rs";
const CORE_ERROR: &str = "crates/core/src/error.rs";
const CORE_TENANT: &str = "crates/core/src/tenant.rs";
const SERVE_PROTOCOL: &str = "crates/serve/src/protocol.rs";
const SERVE_INSTANCE: &str = "crates/serve/src/instance.rs";
const SERVE_ERROR: &str = "crates/serve/src/error.rs";
const SERVE_CONFIG: &str = "crates/serve/src/config.rs";
const GUEST_MODEL: &str = "guest-sdk/src/model.rs";
const GUEST_ELEMENT: &str = "guest-sdk/src/element.rs";
const GUEST_MLIR: &str = "guest-sdk/src/graph/mlir.rs";
const GUEST_ERROR: &str = "guest-sdk/src/error.rs";
const PY_DTYPES: &str = "python/tpubox/_dtypes.py";
const PY_ERRORS: &str = "python/tpubox/errors.py";
const PY_INIT: &str = "python/tpubox/__init__.py";
const PY_KERNELSPEC: &str = "python/tpubox/kernelspec.py";
const PY_PROVISIONER: &str = "python/tpubox/provisioner.py";
const C_TEMPLATE_ERRORS: &str = "host/templates/c/tpubox_errors.h";
const C_EXAMPLE: &str = "examples/c-mlp/mlp.c";
const HOST_MAIN: &str = "host/src/main.rs";
const README: &str = "README.md";
const DOCS_WIT: &str = "docs/WIT.md";
const DOCS_NOTEBOOKS: &str = "docs/NOTEBOOKS.md";
const DOCS_SERVING: &str = "docs/SERVING.md";

/// The `python/tpubox/*.py` modules (not the generated `_proto/`).
fn python_modules() -> Vec<String> {
    let all = files_under("python/tpubox", ".py").into_iter();
    all.filter(|p| !p.contains("/_proto/")).collect()
}

/// The Python modules whose text contains `marker` (at least one), with their texts.
fn python_modules_with(marker: &str) -> Vec<(String, String)> {
    let texts = python_modules().into_iter().map(|p| {
        let t = read(&p);
        (p, t)
    });
    let hits = texts.filter(|(_, t)| t.contains(marker)).collect();
    found(hits, "python/tpubox/*.py", &format!("`{}`", marker.trim()))
}

/// The one Python module whose text contains `marker`, and its text.
fn python_module_with(marker: &str) -> (String, String) {
    let mut hits = python_modules_with(marker);
    if hits.len() > 1 {
        let paths: Vec<&String> = hits.iter().map(|h| &h.0).collect();
        let marker = marker.trim();
        panic!("{HERE}: more than one of python/tpubox/*.py has `{marker}`: {paths:?}")
    }
    hits.pop().unwrap()
}

/// `items` with each `A-B` item replaced by the entries of `order` from A to B
/// (`S8-S64` → `S8`, `S16`, `S32`, `S64`).
fn expand_ranges<'a>(items: impl Iterator<Item = &'a str>, order: &[String]) -> Set {
    let mut out = Set::new();
    for item in items.map(str::trim).filter(|i| !i.is_empty()) {
        let at = |x: &str| order.iter().position(|o| o == x);
        match item.split_once('-').map(|(a, b)| (at(a), at(b))) {
            Some((Some(a), Some(b))) if a <= b => out.extend(order[a..=b].iter().cloned()),
            _ => {
                out.insert(item.to_string());
            }
        }
    }
    out
}

// ------------------------------------------------------------------------------------------
// 1. Dtypes.
// ------------------------------------------------------------------------------------------

/// How each copy spells one WIT dtype.
struct DtypeRow {
    /// The WIT name (`wit/device.wit` `enum dtype`).
    wit: &'static str,
    /// Bytes of one element in the host layout.
    bytes: usize,
    /// XLA name (`PrimitiveType::name`, `session.proto` `DType`).
    xla: &'static str,
    /// Its number in `xla_data.proto` `PrimitiveType` (and `session.proto` `DType`).
    xla_number: i64,
    /// MLIR element type.
    mlir: &'static str,
    /// The `.npy` descr tpubox writes.
    npy: &'static str,
    /// The Python client's NumPy dtype (`np.NAME`, or a module path).
    numpy: &'static str,
    /// safetensors' name, where weight sets can hold it.
    safetensors: Option<&'static str>,
    /// The Open Inference Protocol's datatype, where the protocol has one.
    oip: Option<&'static str>,
}

#[rustfmt::skip]
const DTYPES: &[DtypeRow] = &[
    DtypeRow { wit: "pred", bytes: 1, xla: "PRED", xla_number: 1, mlir: "i1", npy: "|b1", numpy: "bool_", safetensors: Some("BOOL"), oip: Some("BOOL") },
    DtypeRow { wit: "s8", bytes: 1, xla: "S8", xla_number: 2, mlir: "i8", npy: "|i1", numpy: "int8", safetensors: Some("I8"), oip: Some("INT8") },
    DtypeRow { wit: "s16", bytes: 2, xla: "S16", xla_number: 3, mlir: "i16", npy: "<i2", numpy: "int16", safetensors: Some("I16"), oip: Some("INT16") },
    DtypeRow { wit: "s32", bytes: 4, xla: "S32", xla_number: 4, mlir: "i32", npy: "<i4", numpy: "int32", safetensors: Some("I32"), oip: Some("INT32") },
    DtypeRow { wit: "s64", bytes: 8, xla: "S64", xla_number: 5, mlir: "i64", npy: "<i8", numpy: "int64", safetensors: Some("I64"), oip: Some("INT64") },
    DtypeRow { wit: "u8", bytes: 1, xla: "U8", xla_number: 6, mlir: "ui8", npy: "|u1", numpy: "uint8", safetensors: Some("U8"), oip: Some("UINT8") },
    DtypeRow { wit: "u16", bytes: 2, xla: "U16", xla_number: 7, mlir: "ui16", npy: "<u2", numpy: "uint16", safetensors: Some("U16"), oip: Some("UINT16") },
    DtypeRow { wit: "u32", bytes: 4, xla: "U32", xla_number: 8, mlir: "ui32", npy: "<u4", numpy: "uint32", safetensors: Some("U32"), oip: Some("UINT32") },
    DtypeRow { wit: "u64", bytes: 8, xla: "U64", xla_number: 9, mlir: "ui64", npy: "<u8", numpy: "uint64", safetensors: Some("U64"), oip: Some("UINT64") },
    DtypeRow { wit: "f16", bytes: 2, xla: "F16", xla_number: 10, mlir: "f16", npy: "<f2", numpy: "float16", safetensors: Some("F16"), oip: Some("FP16") },
    // NumPy has no bfloat16: `.npy` files hold it as raw 2-byte records (`|V2`), the Python
    // client uses ml_dtypes.
    DtypeRow { wit: "bf16", bytes: 2, xla: "BF16", xla_number: 16, mlir: "bf16", npy: "|V2", numpy: "ml_dtypes.bfloat16", safetensors: Some("BF16"), oip: Some("BF16") },
    DtypeRow { wit: "f32", bytes: 4, xla: "F32", xla_number: 11, mlir: "f32", npy: "<f4", numpy: "float32", safetensors: Some("F32"), oip: Some("FP32") },
    DtypeRow { wit: "f64", bytes: 8, xla: "F64", xla_number: 12, mlir: "f64", npy: "<f8", numpy: "float64", safetensors: Some("F64"), oip: Some("FP64") },
    // `oip: None`: the Open Inference Protocol has no complex datatypes (KServe v2 "Tensor Data
    // Types").
    DtypeRow { wit: "c64", bytes: 8, xla: "C64", xla_number: 15, mlir: "complex<f32>", npy: "<c8", numpy: "complex64", safetensors: Some("C64"), oip: None },
    // `safetensors: None`: safetensors has no complex128. `oip: None`: as for c64.
    DtypeRow { wit: "c128", bytes: 16, xla: "C128", xla_number: 18, mlir: "complex<f64>", npy: "<c16", numpy: "complex128", safetensors: None, oip: None },
];

/// Open Inference Protocol datatypes that are no device dtype: `BYTES` (variable-length byte
/// strings, which the model guest handles itself).
const OIP_ONLY: &[&str] = &["BYTES"];

#[test]
fn dtypes() {
    let r = Report::default();
    let (wit_path, wit) = wit_enum("dtype");
    let wit_ref = format!("{wit_path} `enum dtype`");
    let rows: Vec<String> = DTYPES.iter().map(|d| d.wit.to_string()).collect();
    r.lists(
        "the dtypes",
        &wit_ref,
        &wit,
        &format!("{HERE} DTYPES"),
        &rows,
    );
    for d in DTYPES {
        // An `.npy` descr is its kind letter and element bytes.
        if d.npy[2..].parse::<usize>().ok() != Some(d.bytes) {
            let (w, b, n) = (d.wit, d.bytes, d.npy);
            r.problem(format!(
                "{HERE} DTYPES: `{w}` has {b} bytes but npy descr `{n}`"
            ));
        }
    }
    let reference = format!("{wit_ref} (via DTYPES in {HERE})");
    let maps = |what: &str, want: &Map, copy: &str, found: &Map| {
        r.maps(what, &reference, want, copy, found)
    };
    let lists =
        |copy: &str, found: &[String]| r.lists("the dtypes", &reference, &rows, copy, found);

    // What each copy must map, keyed by WIT dtype.
    let col = |f: fn(&DtypeRow) -> String| -> Map {
        DTYPES.iter().map(|d| (d.wit.to_string(), f(d))).collect()
    };
    let identity = col(|d| d.wit.into());
    let bytes = col(|d| d.bytes.to_string());
    let mlir = col(|d| d.mlir.into());
    // Rust spells a WIT dtype `Bf16`: `wit_of` reads such a name back as the WIT name.
    let by_camel: BTreeMap<String, &str> = DTYPES.iter().map(|d| (camel(d.wit), d.wit)).collect();
    let wit_of = |c: &str| {
        by_camel
            .get(c)
            .map_or(format!("{c} (no WIT dtype)"), |w| w.to_string())
    };
    let wits = |v: Vec<String>| -> Vec<String> { v.iter().map(|x| wit_of(x)).collect() };
    // Match arms as a map, each side read as a WIT dtype (`true`) or kept as it is.
    let keyed = |p: Vec<(String, Option<String>)>, lhs: bool, rhs: bool| {
        let side = |s: String, as_wit: bool| if as_wit { wit_of(&s) } else { s };
        let pair = |(a, b): (String, Option<String>)| {
            (side(a, lhs), b.map_or(NONE.into(), |b| side(b, rhs)))
        };
        map_of(p.into_iter().map(pair))
    };

    // crates/pjrt: PrimitiveType, its ALL, sizes, names, MLIR names, xla_data.proto numbers.
    let src = Src::new(PJRT_TYPES);
    let (copy, v) = src.variants("pub enum PrimitiveType");
    lists(&copy, &wits(v));
    let (copy, v) = src.all("PrimitiveType");
    lists(&copy, &wits(v));
    let (copy, m) = src.arms("fn byte_size(", "", "");
    let m = keyed(m, true, false);
    maps("element bytes", &bytes, &copy, &m);
    let (copy, m) = src.arms("fn name(self)", "", "");
    let m = keyed(m, true, false);
    maps("XLA names", &col(|d| d.xla.into()), &copy, &m);
    let (copy, m) = src.arms("fn mlir_name(", "", "");
    let m = keyed(m, true, false);
    maps("MLIR types", &mlir, &copy, &m);
    let (copy, m) = src.arms("fn from_xla_proto(", "", "");
    let m = map_of(m.into_iter().filter_map(|(n, t)| Some((wit_of(&t?), n))));
    maps(
        "xla_data.proto numbers",
        &col(|d| d.xla_number.to_string()),
        &copy,
        &m,
    );

    // crates/wasm: WIT dtype ↔ PrimitiveType, both ways.
    let src = Src::new(WASM_WIT);
    let marker = "impl From<Dtype> for PrimitiveType";
    let (copy, m) = src.arms(marker, "Dtype::", "PrimitiveType::");
    let m = keyed(m, true, true);
    maps("WIT dtype → PrimitiveType", &identity, &copy, &m);
    let marker = "impl From<PrimitiveType> for Dtype";
    let (copy, m) = src.arms(marker, "PrimitiveType::", "Dtype::");
    let m = keyed(m, true, true);
    maps("PrimitiveType → WIT dtype", &identity, &copy, &m);

    // session.proto `enum DType`: XLA names and numbers. `DTYPE_UNSPECIFIED = 0` is proto3's
    // required zero value (no dtype; the daemon refuses it).
    let src = Src::new(SESSION_PROTO);
    let entries = found(
        proto_enum(src.block("enum DType")),
        &src.path,
        "entries of `enum DType`",
    );
    let by_xla: BTreeMap<&str, &str> = DTYPES.iter().map(|d| (d.xla, d.wit)).collect();
    let specified = entries
        .into_iter()
        .filter(|(n, v)| (n.as_str(), *v) != ("DTYPE_UNSPECIFIED", 0));
    let m = map_of(specified.map(|(n, v)| {
        let key = by_xla
            .get(n.as_str())
            .map_or(format!("{n} (no WIT dtype)"), |w| w.to_string());
        (key, format!("{n} = {v}"))
    }));
    let want = col(|d| format!("{} = {}", d.xla, d.xla_number));
    maps(
        "proto names and numbers",
        &want,
        &src.label("enum DType"),
        &m,
    );

    // The session API: wire DType ↔ PrimitiveType (prost spells `BF16` `Bf16`), and the list
    // its error message gives.
    let src = Src::new(SESSION_GRPC);
    let (copy, m) = src.arms("fn primitive(", "Ok(DType::", "P::");
    let m = m
        .into_iter()
        .filter(|(k, _)| k != "DtypeUnspecified")
        .collect();
    let m = keyed(m, true, true);
    maps("wire DType → PrimitiveType", &identity, &copy, &m);
    let (copy, m) = src.arms("fn dtype(", "P::", "DType::");
    let m = keyed(m, true, true);
    maps("PrimitiveType → wire DType", &identity, &copy, &m);
    let listed = between(&src.code, "is not one tpubox supports (", ")", &src.path);
    let xla_order: Vec<String> = DTYPES.iter().map(|d| d.xla.to_string()).collect();
    let named = expand_ranges(listed.split(','), &xla_order);
    let copy = format!("{SESSION_GRPC} (the error message of `primitive`)");
    r.sets(
        "the supported dtypes",
        &reference,
        &set_of(&xla_order),
        &copy,
        &named,
    );

    // crates/core weights.rs: safetensors name → PrimitiveType (a subset, see DTYPES).
    let src = Src::new(CORE_WEIGHTS);
    let (copy, m) = src.arms("fn xla_type(", "Dtype::", "PrimitiveType::");
    let want = map_of(
        DTYPES
            .iter()
            .filter_map(|d| Some((d.safetensors?.into(), d.wit.into()))),
    );
    let m = keyed(m, false, true);
    maps("safetensors dtype → WIT dtype", &want, &copy, &m);

    // crates/core npy.rs: the descr written for each type, and the descrs read back. A raw
    // `VN` descr names no type (BF16 is read from `|V2` only when the caller expects BF16).
    let src = Src::new(CORE_NPY);
    let (copy, m) = src.arms("fn numpy_descr(", "PrimitiveType::", "");
    let m = keyed(m, true, false);
    maps("npy descrs", &col(|d| d.npy.into()), &copy, &m);
    let (copy, m) = src.arms("fn xla_type_of(", "", "PrimitiveType::");
    let typed = DTYPES.iter().filter(|d| !d.npy[1..].starts_with('V'));
    let want = map_of(typed.map(|d| (d.npy[1..].to_string(), d.wit.to_string())));
    let m = keyed(m, false, true);
    maps("npy descr → WIT dtype", &want, &copy, &m);

    // The Python client: NumPy dtype ↔ wire DType (`np.dtype(np.int8): pb.S8`, or a name bound
    // to `np.dtype(...)` above the table, as `BFLOAT16`).
    let py = read(PY_DTYPES);
    let numpy_of = |key: &str| -> String {
        let key = key.trim();
        let inner = match key.strip_prefix("np.dtype(") {
            Some(k) => k.trim_end_matches(')').to_string(),
            None => {
                let bound = format!("{key} = np.dtype(");
                let value = py
                    .lines()
                    .find_map(|l| l.trim().strip_prefix(bound.as_str()));
                value.map_or(format!("{key} (unbound)"), |v| {
                    v.trim_end_matches(')').into()
                })
            }
        };
        inner.strip_prefix("np.").unwrap_or(&inner).to_string()
    };
    let by_numpy: BTreeMap<&str, &str> = DTYPES.iter().map(|d| (d.numpy, d.wit)).collect();
    let entries = split_top(block(&py, "_TO_WIRE", PY_DTYPES), ',', false);
    let entries = found(entries, PY_DTYPES, "entries of `_TO_WIRE`");
    let m = map_of(entries.iter().filter_map(|e| {
        let (k, v) = e.rsplit_once(':')?;
        let np = numpy_of(k);
        let key = by_numpy
            .get(np.as_str())
            .map_or(format!("numpy {np} (no DTYPES row)"), |w| w.to_string());
        Some((
            key,
            format!("{np} ↔ {}", v.trim().trim_start_matches("pb.")),
        ))
    }));
    let want = col(|d| format!("{} ↔ {}", d.numpy, d.xla));
    maps(
        "NumPy dtype ↔ wire DType",
        &want,
        &format!("{PY_DTYPES} `_TO_WIRE`"),
        &m,
    );
    // Its docs: "Supported dtypes: bool, int8-int64, ...".
    let names: Vec<String> = DTYPES
        .iter()
        .map(|d| d.numpy.trim_end_matches('_').into())
        .collect();
    for (path, text) in python_modules_with("Supported dtypes:") {
        let prose = between(&text, "Supported dtypes:", ". ", &path).replace("``", "");
        let items: Vec<String> = prose
            .split(',')
            .map(|s| s.split_whitespace().collect())
            .collect();
        let named = expand_ranges(items.iter().map(String::as_str), &names);
        let copy = format!("{path} (\"Supported dtypes: ...\")");
        r.sets(
            "the supported NumPy dtypes",
            &reference,
            &set_of(&names),
            &copy,
            &named,
        );
    }

    // The Open Inference Protocol: wit/model.wit `enum datatype` is the reference of its names
    // and order; DTYPES says which device dtype holds each.
    let (model_path, oip_wit) = wit_enum("datatype");
    let oip_ref = format!("{model_path} `enum datatype`");
    let oip_names: Vec<String> = oip_wit.iter().map(|d| d.to_uppercase()).collect();
    let oip: Vec<String> = oip_wit.iter().map(|d| camel(d)).collect();
    let table = format!("{HERE} DTYPES (`oip`) and OIP_ONLY");
    let in_table = set_of(
        DTYPES
            .iter()
            .filter_map(|d| d.oip)
            .chain(OIP_ONLY.iter().copied()),
    );
    r.sets(
        "the protocol's datatypes",
        &oip_ref,
        &set_of(&oip_names),
        &table,
        &in_table,
    );
    let oip_lists = |copy: &str, found: &[String]| {
        r.lists("the protocol's datatypes", &oip_ref, &oip, copy, found)
    };
    let oip_maps =
        |what: &str, want: &Map, copy: &str, found: &Map| r.maps(what, &oip_ref, want, copy, found);
    let oip_col = |f: fn(&DtypeRow) -> String| -> Map {
        let only = OIP_ONLY.iter().map(|o| (camel(o), NONE.to_string()));
        map_of(
            DTYPES
                .iter()
                .filter_map(|d| Some((camel(d.oip?), f(d))))
                .chain(only),
        )
    };
    let oip_bytes = oip_col(|d| d.bytes.to_string());
    let oip_dtype = oip_col(|d| d.wit.to_string());
    let oip_name = map_of(oip.iter().cloned().zip(oip_names.iter().cloned()));
    let oip_identity = map_of(oip.iter().map(|c| (c.clone(), c.clone())));

    let src = Src::new(SERVE_PROTOCOL);
    let (copy, v) = src.variants("pub enum Datatype");
    oip_lists(&copy, &v);
    let (copy, v) = src.all("Datatype");
    oip_lists(&copy, &v);
    let (copy, m) = src.arms("fn name(self)", "Datatype::", "");
    let m = keyed(m, false, false);
    oip_maps("protocol names", &oip_name, &copy, &m);
    let (copy, m) = src.arms("fn element_size(", "Datatype::", "");
    let m = keyed(m, false, false);
    maps("element bytes", &oip_bytes, &copy, &m);
    let src = Src::new(SERVE_INSTANCE);
    let (copy, m) = src.arms("fn to_wit(", "Datatype::", "W::");
    let m = keyed(m, false, false);
    oip_maps("Datatype → WIT datatype", &oip_identity, &copy, &m);
    let (copy, m) = src.arms("fn from_wit(", "W::", "Datatype::");
    let m = keyed(m, false, false);
    oip_maps("WIT datatype → Datatype", &oip_identity, &copy, &m);

    // The guest SDK: datatype ↔ dtype, names, order; dtype sizes, names, MLIR types.
    let src = Src::new(GUEST_MODEL);
    let (copy, v) = src.all("Datatype");
    oip_lists(&copy, &v);
    let (copy, m) = src.arms("fn name(self)", "Datatype::", "");
    let m = keyed(m, false, false);
    oip_maps("protocol names", &oip_name, &copy, &m);
    let (copy, m) = src.arms("fn dtype(self)", "Datatype::", "Dtype::");
    let m = keyed(m, false, true);
    maps("protocol datatype → WIT dtype", &oip_dtype, &copy, &m);
    let (copy, m) = src.arms("fn from_dtype(", "Dtype::", "Datatype::");
    let want = col(|d| d.oip.map_or(NONE.into(), camel));
    let m = keyed(m, true, false);
    maps("WIT dtype → protocol datatype", &want, &copy, &m);
    let src = Src::new(GUEST_ELEMENT);
    let (copy, v) = src.all("Dtype");
    lists(&copy, &wits(v));
    let (copy, m) = src.arms("fn size_bytes(", "Dtype::", "");
    let m = keyed(m, true, false);
    maps("element bytes", &bytes, &copy, &m);
    let (copy, m) = src.arms("fn name(self)", "Dtype::", "");
    let m = keyed(m, true, false);
    maps("WIT names", &identity, &copy, &m);
    let src = Src::new(GUEST_MLIR);
    let (copy, m) = src.arms("fn mlir_element_type(", "Dtype::", "");
    let m = keyed(m, true, false);
    maps("MLIR types", &mlir, &copy, &m);

    // docs/SERVING.md lists the protocol's datatypes.
    let text = read(DOCS_SERVING);
    let listed = between(&text, "Datatypes: ", ".", DOCS_SERVING).split(',');
    let listed: Vec<String> = listed.map(|s| s.trim().to_string()).collect();
    let copy = format!("{DOCS_SERVING} (\"Datatypes: ...\")");
    r.lists(
        "the protocol's datatypes",
        &oip_ref,
        &oip_names,
        &copy,
        &listed,
    );

    r.finish("dtype");
}

// ------------------------------------------------------------------------------------------
// 2. Error kinds.
// ------------------------------------------------------------------------------------------

/// Kinds the session API sends besides the WIT ones: it refuses a request before any device
/// call when the token is missing or unknown, or the session has ended. A guest never sees
/// them, so they are no WIT kinds.
const SESSION_KINDS: &[&str] = &["unauthenticated", "session-ended"];

/// Kinds the Python client makes itself, never sent by the daemon: the daemon cannot be
/// reached, or a call ran past its deadline.
const CLIENT_KINDS: &[&str] = &["unavailable", "deadline-exceeded"];

#[test]
fn error_kinds() {
    let r = Report::default();
    let (wit_path, kinds) = wit_enum("error-kind");
    let reference = format!("{wit_path} `enum error-kind`");
    let camels: Vec<String> = kinds.iter().map(|k| camel(k)).collect();
    let by_camel = map_of(camels.iter().cloned().zip(kinds.iter().cloned()));
    let kind_of = |c: &str| {
        by_camel
            .get(c)
            .cloned()
            .unwrap_or(format!("{c} (no WIT kind)"))
    };
    let identity = map_of(kinds.iter().map(|k| (k.clone(), k.clone())));
    let maps =
        |what: &str, copy: &str, found: &Map| r.maps(what, &reference, &identity, copy, found);
    let lists = |copy: &str, found: &[String], want: &[String]| {
        r.lists("the error kinds", &reference, want, copy, found)
    };
    // Match arms as a map, the left side read as a WIT kind, the right one too when `rhs`.
    let keyed = |p: Vec<(String, Option<String>)>, rhs: bool| {
        let right = |b: String| if rhs { kind_of(&b) } else { b };
        map_of(
            p.into_iter()
                .map(|(a, b)| (kind_of(&a), b.map_or(NONE.into(), right))),
        )
    };

    // The host's ErrorKind: variants and ALL in WIT order, `as_str` the WIT names; its
    // conversion to the WIT type; the guest SDK's names.
    let src = Src::new(CORE_ERROR);
    let (copy, v) = src.variants("pub enum ErrorKind");
    lists(&copy, &v, &camels);
    let (copy, v) = src.all("ErrorKind");
    lists(&copy, &v, &camels);
    let (copy, m) = src.arms("fn as_str(", "ErrorKind::", "");
    let m = keyed(m, false);
    maps("kind names", &copy, &m);
    let src = Src::new(WASM_WIT);
    let marker = "impl From<ErrorKind> for WitErrorKind";
    let (copy, m) = src.arms(marker, "ErrorKind::", "WitErrorKind::");
    let m = keyed(m, true);
    maps("ErrorKind → WIT error-kind", &copy, &m);
    let src = Src::new(GUEST_ERROR);
    let (copy, m) = src.arms("fn name(self)", "ErrorKind::", "");
    let m = keyed(m, false);
    maps("kind names", &copy, &m);

    // The session API: a gRPC code for every WIT kind, the kinds it sends itself (literals
    // given to `status_with_kind`), the trailer's key.
    let src = Src::new(SESSION_GRPC);
    let (copy, m) = src.arms("fn device_status(", "ErrorKind::", "tonic::Code::");
    let mut daemon_codes = keyed(m, false);
    maps(
        "kinds given a gRPC code",
        &copy,
        &map_of(daemon_codes.keys().map(|k| (k.clone(), k.clone()))),
    );
    let mut own = Set::new();
    let code = &src.code;
    for (i, _) in code
        .match_indices("status_with_kind(")
        .filter(|(i, _)| !code[..*i].ends_with("fn "))
    {
        let Some(end) = close_of(code, i + "status_with_kind".len()) else {
            continue;
        };
        let args = split_top(&code[i + "status_with_kind(".len()..end - 1], ',', false);
        if let [c, k, ..] = &args[..]
            && k.starts_with('"')
            && let Some(kind) = atom(k, "")
        {
            own.insert(kind.clone());
            daemon_codes.insert(kind, c.rsplit("::").next().unwrap_or(c).to_string());
        }
    }
    let copy = format!("{SESSION_GRPC} (`status_with_kind` calls)");
    let session_ref = format!("{HERE} SESSION_KINDS");
    r.sets(
        "the session API's own kinds",
        &session_ref,
        &set_of(SESSION_KINDS),
        &copy,
        &own,
    );
    let key = atom(
        between(code, "ERROR_KIND_KEY: &str =", ";", SESSION_GRPC),
        "",
    );
    let key = key.unwrap_or_else(|| none_found(SESSION_GRPC, "the value of `ERROR_KIND_KEY`"));

    // session.proto's comment names every kind the trailer carries, and the trailer.
    let text = read(SESSION_PROTO);
    let prose = between(&text, "kebab-case names of", "is in the", SESSION_PROTO);
    let named = set_of(
        backticked(prose)
            .into_iter()
            .filter(|k| !k.contains([':', '.', '/'])),
    );
    let daemon_kinds = set_of(
        kinds
            .iter()
            .map(String::as_str)
            .chain(SESSION_KINDS.iter().copied()),
    );
    let daemon_ref = format!("{reference} and {HERE} SESSION_KINDS");
    let copy = format!("{SESSION_PROTO} (its header comment)");
    r.sets(
        "the kinds of the trailer",
        &daemon_ref,
        &daemon_kinds,
        &copy,
        &named,
    );
    if !text.contains(&format!("`{key}` trailer")) {
        r.problem(format!(
            "{SESSION_PROTO} does not name the `{key}` trailer of {SESSION_GRPC}"
        ));
    }

    // The Python client: an exception class per kind, named after it, and its tables.
    let py = read(PY_ERRORS);
    let classes = py_classes(&py)
        .into_iter()
        .filter(|(_, base, _)| base == "TpuboxError");
    let classes: Vec<(String, String)> = classes
        .filter_map(|(name, _, body)| {
            let kind = body
                .lines()
                .find_map(|l| l.trim().strip_prefix("KIND = "))?;
            Some((kind.trim_matches('"').to_string(), name))
        })
        .collect();
    let classes = map_of(found(
        classes,
        PY_ERRORS,
        "`class X(TpuboxError)` with a `KIND`",
    ));
    let every = daemon_kinds
        .iter()
        .map(String::as_str)
        .chain(CLIENT_KINDS.iter().copied());
    let every = map_of(every.map(|k| (k.to_string(), camel(k))));
    let every_ref = format!("{reference}, {HERE} SESSION_KINDS and CLIENT_KINDS");
    let copy = format!("{PY_ERRORS} (the `KIND` of each class)");
    r.maps(
        "the exception classes (kind → class)",
        &every_ref,
        &every,
        &copy,
        &classes,
    );
    let class_names = set_of(classes.values());
    for path in [PY_ERRORS, PY_INIT] {
        let all = py_str_list(&read(path), "__all__", path);
        let missing: Vec<&String> = class_names.iter().filter(|c| !all.contains(c)).collect();
        if !missing.is_empty() {
            r.problem(format!(
                "{path} `__all__` lacks the classes {missing:?} of {PY_ERRORS}"
            ));
        }
    }
    let by_kind = between(&py, "for c in (", ")", PY_ERRORS)
        .split(',')
        .map(str::trim);
    let by_kind = set_of(by_kind.filter(|s| !s.is_empty()));
    let classes_ref = format!("{PY_ERRORS} (its exception classes)");
    let copy = format!("{PY_ERRORS} `_BY_KIND`");
    r.sets(
        "the classes `error()` raises",
        &classes_ref,
        &class_names,
        &copy,
        &by_kind,
    );
    let py_key = atom(between(&py, "ERROR_KIND_KEY =", "\n", PY_ERRORS), "").unwrap_or_default();
    if py_key != key {
        r.problem(format!(
            "the trailer: {SESSION_GRPC} says `{key}`, {PY_ERRORS} says `{py_key}`"
        ));
    }
    // Without the trailer the client guesses the kind from the gRPC code: for every code the
    // daemon sends, the guess must be a kind the daemon sends with that code.
    let by_code = map_of(block(&py, "_BY_CODE", PY_ERRORS).lines().filter_map(|l| {
        let (c, k) = l.split_once(':')?;
        Some((
            c.trim().trim_start_matches("grpc.StatusCode.").to_string(),
            atom(k, "")?,
        ))
    }));
    let _ = found(by_code.keys().collect(), PY_ERRORS, "entries of `_BY_CODE`");
    let code_of = |k: &str| {
        daemon_codes
            .get(k)
            .map_or("no code".into(), |c| screaming_of_camel(c))
    };
    for code in set_of(daemon_codes.values()) {
        let upper = screaming_of_camel(&code);
        let sent: Vec<&String> = daemon_codes
            .keys()
            .filter(|k| daemon_codes[*k] == code)
            .collect();
        match by_code.get(&upper) {
            None => r.problem(format!(
                "{PY_ERRORS} `_BY_CODE` has no `{upper}`, which {SESSION_GRPC} sends for {sent:?}"
            )),
            Some(k) if daemon_codes.get(k) != Some(&code) => r.problem(format!(
                "{PY_ERRORS} `_BY_CODE` guesses `{k}` from `{upper}`, but {SESSION_GRPC} sends \
                 `{k}` with `{}` (and `{upper}` for {sent:?})",
                code_of(k)
            )),
            Some(_) => {}
        }
    }

    // The C template's names, and the C example's table (indexed by the enum's value: order
    // matters).
    let src = Src::new(C_TEMPLATE_ERRORS);
    let prefix = "case TPUBOX_DEVICE_TYPES_ERROR_KIND_";
    let cases = src.code.lines().filter_map(|l| {
        let (name, value) = l.trim().strip_prefix(prefix)?.split_once(':')?;
        let kind = kinds
            .iter()
            .find(|k| k.to_uppercase().replace('-', "_") == name);
        let kind = kind.cloned().unwrap_or(format!("{name} (no WIT kind)"));
        Some((kind, atom(value.trim().trim_start_matches("return"), "")?))
    });
    let what = format!("`{prefix}X: return \"x\";` lines");
    let cases = map_of(found(cases.collect(), &src.path, &what));
    maps("kind names", &src.label("tpubox_error_kind_name"), &cases);
    let src = Src::new(C_EXAMPLE);
    let names = found(
        quoted(src.block("KIND_NAMES[] =")),
        &src.path,
        "strings of `KIND_NAMES`",
    );
    lists(&src.label("KIND_NAMES"), &names, &kinds);

    // docs/WIT.md lists the kinds; docs/NOTEBOOKS.md tabulates the Python classes.
    let text = read(DOCS_WIT);
    lists(
        DOCS_WIT,
        &backticked(between(
            &text,
            "kinds a guest can branch on:",
            "|",
            DOCS_WIT,
        )),
        &kinds,
    );
    let text = read(DOCS_NOTEBOOKS);
    let table = md_table(&text, "| `kind` |", DOCS_NOTEBOOKS);
    let m = map_of(table.iter().filter_map(|row| {
        let class = backticked(row.first()?).into_iter().next()?;
        Some((backticked(row.get(1)?).into_iter().next()?, class))
    }));
    let copy = format!("{DOCS_NOTEBOOKS} (the errors table)");
    r.maps(
        "the exception classes (kind → class)",
        &classes_ref,
        &classes,
        &copy,
        &m,
    );

    // The serve error mapping singles out the kinds wit/model.wit's `infer` says reach the
    // client as something else than a server error (500).
    let src = Src::new(SERVE_ERROR);
    let (copy, m) = src.arms("fn from_model(", "ErrorKind::", "");
    let singled = set_of(m.into_iter().map(|(k, _)| kind_of(&k)));
    let (model_path, _) = wit_enum("datatype");
    let text = read(&model_path);
    let Some(at) = text.find("infer: func") else {
        none_found(&model_path, "`infer: func`")
    };
    let above = text[..at].lines().rev().skip(1);
    let doc: Vec<&str> = above
        .take_while(|l| l.trim_start().starts_with("///"))
        .collect();
    let doc = doc.into_iter().rev().collect::<Vec<_>>().join(" ");
    let errors = doc.split_once("Errors:").map_or("", |(_, e)| e);
    let documented = set_of(backticked(errors).into_iter().filter(|k| kinds.contains(k)));
    let docs_ref = format!("{model_path} (the errors of `infer`)");
    r.sets(
        "the kinds that are no server errors",
        &docs_ref,
        &documented,
        &copy,
        &singled,
    );

    r.finish("error kind");
}

// ------------------------------------------------------------------------------------------
// 3. Tenant limits.
// ------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Debug)]
enum Unit {
    /// `_bytes` on the wire (the Python kernelspec parses those as sizes), `_mib` in TOML and
    /// flags.
    Bytes,
    /// `_seconds`, a `double` on the wire.
    Seconds,
    /// A count.
    Count,
    /// Neither (fuel units, a policy).
    Other,
}

/// How each copy names one limit; `None` where a copy deliberately lacks it.
struct LimitRow {
    /// The `TenantLimits` field (for a session-only limit: the `SessionLimits` field, or the
    /// `[tenant.session]` key).
    key: &'static str,
    /// A limit of a session, no field of `TenantLimits`.
    session_only: bool,
    unit: Unit,
    /// Its name in errors (`max-device-bytes`).
    name: Option<&'static str>,
    /// Whether `resource-exhausted` names it (`(limit NAME)`).
    refused: bool,
    /// Its session API name: `session.proto` `Limits`, `RequestedLimits`, the Python `Limits`.
    wire: Option<&'static str>,
    /// Its key in the tokens file's `[tenant.session]`.
    policy: Option<&'static str>,
    /// Its key in a model's `[tpubox.limits]`.
    model: Option<&'static str>,
    /// Its `tpubox run` flag.
    cli: Option<&'static str>,
}

const LIMITS: &[LimitRow] = &[
    LimitRow {
        key: "max_device_bytes",
        session_only: false,
        unit: Unit::Bytes,
        name: Some("max-device-bytes"),
        refused: true,
        wire: Some("max_device_bytes"),
        policy: Some("max_device_mib"),
        model: Some("max_device_mib"),
        cli: Some("--max-device-mib"),
    },
    LimitRow {
        key: "max_live_tensors",
        session_only: false,
        unit: Unit::Count,
        name: Some("max-live-tensors"),
        refused: true,
        wire: Some("max_live_tensors"),
        policy: Some("max_live_tensors"),
        model: Some("max_live_tensors"),
        cli: Some("--max-tensors"),
    },
    LimitRow {
        key: "max_live_executables",
        session_only: false,
        unit: Unit::Count,
        name: Some("max-live-executables"),
        refused: true,
        wire: Some("max_live_executables"),
        policy: Some("max_live_executables"),
        model: Some("max_live_executables"),
        cli: Some("--max-executables"),
    },
    LimitRow {
        key: "max_program_bytes",
        session_only: false,
        unit: Unit::Bytes,
        name: Some("max-program-bytes"),
        refused: true,
        wire: Some("max_program_bytes"),
        policy: Some("max_program_mib"),
        // `[tpubox.limits]` (crates/serve/src/config.rs `ModelLimits`) has no
        // `max_program_mib` although `[tenant.session]` has one: a model's tenant gets the
        // default. Known gap, left for an issue of its own (a new config key is a behaviour
        // change, which the structure issue excluded); this row makes adding it one edit here.
        model: None,
        // `tpubox run` takes the host's program limit (`HostConfig::max_program_bytes`); the
        // README's table says it has no flag.
        cli: None,
    },
    LimitRow {
        key: "max_compiles_per_minute",
        session_only: false,
        unit: Unit::Count,
        name: Some("max-compiles-per-minute"),
        refused: true,
        wire: Some("max_compiles_per_minute"),
        policy: Some("max_compiles_per_minute"),
        // As for `max_program_bytes`: `[tpubox.limits]` has no `max_compiles_per_minute`,
        // `[tenant.session]` has (known gap, left for its own issue).
        model: None,
        cli: Some("--max-compiles-per-minute"),
    },
    LimitRow {
        key: "max_guest_memory",
        session_only: false,
        unit: Unit::Bytes,
        name: Some("max-guest-memory"),
        refused: true,
        wire: Some("max_guest_memory_bytes"),
        policy: Some("max_guest_memory_mib"),
        model: Some("max_guest_memory_mib"),
        cli: Some("--max-memory-mib"),
    },
    LimitRow {
        key: "max_call_time",
        session_only: false,
        unit: Unit::Seconds,
        // The name a request above the tenant's value is refused with. Reaching the limit
        // stops the guest (a trap), which no `resource-exhausted` names.
        name: Some("max-call-seconds"),
        refused: false,
        wire: Some("max_call_seconds"),
        policy: Some("max_call_seconds"),
        model: Some("max_call_seconds"),
        cli: Some("--timeout"),
    },
    LimitRow {
        key: "fuel",
        session_only: false,
        unit: Unit::Other,
        // Running out stops the guest (a trap); no error names it.
        name: None,
        refused: false,
        // Fuel metering is a switch of the whole wasmtime engine
        // (`SandboxConfig::consume_fuel`); the daemon's engine serves every session and model,
        // so only `tpubox run`, which has its own, offers fuel.
        wire: None,
        policy: None,
        model: None,
        cli: Some("--fuel"),
    },
    LimitRow {
        key: "program_policy",
        session_only: false,
        unit: Unit::Other,
        // Its rules are named instead (`unbounded-loop`, `max-loop-trips`, ...).
        name: None,
        refused: false,
        // Trust is the operator's to give (the tokens file); a client may only narrow limits.
        wire: None,
        policy: Some("trusted"),
        // `[tpubox.limits] trusted` (issue 29: an operator lifts the policy for a model whose
        // programs it trusts, e.g. an exported StableHLO model with an unbounded loop).
        model: Some("trusted"),
        cli: Some("--trusted"),
    },
    // The loop budget (issue 31): fields of `ProgramPolicy`, inside `TenantLimits`'s
    // `program_policy`. Like the session-only rows they are no `TenantLimits` field of their
    // own; `[tenant.session]`, `[tpubox.limits]` and the flags of `tpubox run`/`exec` set them.
    // `resource-exhausted` names them from the budget's custom call (crates/pjrt-kernels), not
    // from a `refuse(`.
    LimitRow {
        key: "program_policy",
        session_only: true,
        unit: Unit::Count,
        name: Some("max-loop-iterations"),
        refused: false,
        wire: None,
        policy: Some("max_loop_iterations"),
        model: Some("max_loop_iterations"),
        cli: Some("--max-loop-iterations"),
    },
    LimitRow {
        key: "program_policy",
        session_only: true,
        unit: Unit::Other,
        name: Some("max-loop-work"),
        refused: false,
        wire: None,
        policy: Some("max_loop_work"),
        model: Some("max_loop_work"),
        cli: Some("--max-loop-work"),
    },
    LimitRow {
        key: "max_pending_launches",
        session_only: false,
        unit: Unit::Count,
        name: Some("max-pending-launches"),
        refused: true,
        wire: Some("max_pending_launches"),
        policy: Some("max_pending_launches"),
        model: Some("max_pending_launches"),
        cli: Some("--max-pending-launches"),
    },
    // The publish ledger (issue 34): a tenant's live published weight versions, counted by
    // tenant name and outliving its sessions. Set by the operator only (not on the wire: a
    // session cannot narrow what its tenant's other sessions share), for daemon sessions only
    // (`tpubox run` leaves it 0).
    LimitRow {
        key: "max_published_bytes",
        session_only: false,
        unit: Unit::Bytes,
        name: Some("max-published-bytes"),
        refused: true,
        wire: None,
        policy: Some("max_published_mib"),
        model: None,
        cli: None,
    },
    // `publish_weights` turns publishing on (at `max_device_mib` unless `max_published_mib`
    // says otherwise): the same limit, a second key.
    LimitRow {
        key: "max_published_bytes",
        session_only: true,
        unit: Unit::Other,
        name: None,
        refused: false,
        wire: None,
        policy: Some("publish_weights"),
        model: None,
        cli: None,
    },
    LimitRow {
        key: "max_published_versions",
        session_only: false,
        unit: Unit::Count,
        name: Some("max-published-versions"),
        refused: true,
        wire: None,
        policy: Some("max_published_versions"),
        model: None,
        cli: None,
    },
    // Slots of the device's execution queue a tenant's executions hold at once: the
    // scheduler waits (it refuses nothing), and only a budget's value is set (below).
    LimitRow {
        key: "max_running_executions",
        session_only: false,
        unit: Unit::Count,
        name: Some("max-running-executions"),
        refused: false,
        wire: None,
        policy: None,
        model: None,
        cli: None,
    },
    // `SessionLimits::idle_timeout`: how long a session may sit unused, a limit of the session
    // itself, not of what its tenant holds.
    LimitRow {
        key: "idle_timeout",
        session_only: true,
        unit: Unit::Seconds,
        name: Some("idle-timeout-seconds"),
        refused: false,
        wire: Some("idle_timeout_seconds"),
        policy: Some("idle_timeout_seconds"),
        model: None,
        cli: None,
    },
    // How many sessions a tenant may have open: a rule of the tokens file about the tenant, not
    // a limit one session holds, so it is not on the wire.
    LimitRow {
        key: "max_sessions",
        session_only: true,
        unit: Unit::Count,
        name: Some("max-sessions"),
        refused: true,
        wire: None,
        policy: Some("max_sessions"),
        model: None,
        cli: None,
    },
    // The tenant's budget, all its sessions together (`SessionPolicy::budget_limits`): rules of
    // the tokens file about the tenant, like `max_sessions`; a refusal names
    // `max-device-bytes`, which says whose it was.
    LimitRow {
        key: "tenant_max_device_mib",
        session_only: true,
        unit: Unit::Bytes,
        name: None,
        refused: false,
        wire: None,
        policy: Some("tenant_max_device_mib"),
        model: None,
        cli: None,
    },
    // Device bytes on any one device (issue 44): the operator's rule (not on the wire), for
    // daemon sessions; `tpubox run` places a guest with `--devices` but sets no per-device cap.
    LimitRow {
        key: "max_device_bytes_per_device",
        session_only: false,
        unit: Unit::Bytes,
        name: Some("max-device-bytes-per-device"),
        refused: true,
        wire: None,
        policy: Some("max_per_device_mib"),
        model: None,
        cli: None,
    },
    LimitRow {
        key: "tenant_max_per_device_mib",
        session_only: true,
        unit: Unit::Bytes,
        name: None,
        refused: false,
        wire: None,
        policy: Some("tenant_max_per_device_mib"),
        model: None,
        cli: None,
    },
    // Which devices a tenant's sessions may use and hold (issue 44, `tpubox_core::placement`):
    // a rule of the tokens file (and of a model's `[tpubox.limits]`), no `TenantLimits` field.
    // A session's request its devices cannot meet is refused `(limit devices)`; the refusal
    // scan above reads `max-` names only, so `refused` stays false here.
    LimitRow {
        key: "devices",
        session_only: true,
        unit: Unit::Other,
        name: Some("devices"),
        refused: false,
        wire: None,
        policy: Some("devices"),
        model: Some("devices"),
        cli: Some("--devices"),
    },
    LimitRow {
        key: "exclusive_devices",
        session_only: true,
        unit: Unit::Other,
        name: None,
        refused: false,
        wire: None,
        policy: Some("exclusive_devices"),
        model: None,
        cli: None,
    },
    LimitRow {
        key: "tenant_max_running_executions",
        session_only: true,
        unit: Unit::Count,
        name: None,
        refused: false,
        wire: None,
        policy: Some("tenant_max_running_executions"),
        model: None,
        cli: None,
    },
];

/// Limits of the host, not of a tenant, that `resource-exhausted` also names (the compile
/// workers' limits of `HostConfig`).
const HOST_LIMITS: &[&str] = &[
    "max-compile-seconds",
    "max-compile-memory",
    "max-compile-resident",
    "max-compile-workers",
    "max-compile-workers-per-tenant",
];

/// Program policy rules named like limits (refused as `permission-denied`).
const PROGRAM_RULES: &[&str] = &["max-loop-trips"];

/// Flags in the README's limits table that set no tenant limit: the host's compile limits.
const README_HOST_FLAGS: &[&str] = &[
    "--max-compile-seconds",
    "--max-compile-workers",
    "--max-compile-workers-per-tenant",
    "--max-compile-resident-mib",
    "--prestarted-compile-workers",
];

/// Where each `PREFIX.field` in `code` goes (a `SessionPolicy` or `ModelLimits` field): the
/// `t.TARGET` it sets, or the struct field it initialises, and the code that converts it.
fn limit_assignments(code: &str, prefix: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (pos, field) in uses(code, prefix) {
        let start = code[..pos].rfind([';', '}']).map_or(0, |i| i + 1);
        let stmt = &code[start..pos];
        let (target, conversion) = if stmt.contains("if let Some(") {
            let inner = block(&code[pos..], "", "(an if-let)");
            let t = uses(inner, "t.")
                .first()
                .map_or("?".to_string(), |(_, t)| t.clone());
            (t, inner.to_string())
        } else if let Some((_, t)) = uses(stmt, "t.").last() {
            let end = code[pos..].find(';').map_or(code.len(), |e| pos + e);
            (t.clone(), code[start..end].to_string())
        } else {
            let t = stmt.trim_end().trim_end_matches(':');
            let t: String = t
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            (t.chars().rev().collect(), String::new())
        };
        out.push((field, target, conversion));
    }
    out
}

/// The Python `Limits` class body's fields (`name: type = default`) and the docs of each in
/// its docstring (`name: text` in `Args:`).
fn py_limits(body: &str) -> (Map, Map) {
    let (mut fields, mut docs) = (Map::new(), Map::new());
    let (mut in_doc, mut last) = (false, String::new());
    let name_colon = |t: &str| {
        let (f, rest) = t.split_once(':')?;
        (!f.is_empty() && ident(f) == f).then(|| (f.to_string(), rest.to_string()))
    };
    for line in body.lines() {
        let quotes = line.matches("\"\"\"").count();
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        if in_doc || quotes > 0 {
            if let Some((f, rest)) = name_colon(t).filter(|_| indent == 8) {
                last = f.clone();
                docs.insert(f, rest);
            } else if indent > 8 && !last.is_empty() {
                docs.entry(last.clone()).or_default().push_str(t);
            }
        } else if indent == 4
            && let Some((f, rest)) = name_colon(t)
        {
            fields.insert(f, rest.split('=').next().unwrap_or("").trim().to_string());
        }
        if quotes % 2 == 1 {
            in_doc = !in_doc;
        }
    }
    (fields, docs)
}

/// `tpubox run`'s flag for the `RunArgs` field `field`, and its `default_value_t`.
fn flag_of(run_args: &[Field], field: &str) -> Option<(String, Option<String>)> {
    let f = run_args.iter().find(|f| f.name == field)?;
    let attrs = f.attrs.trim_start_matches("#[arg(").trim_end_matches(")]");
    let args = split_top(attrs, ',', false);
    let long = match f.attrs.split("long = \"").nth(1) {
        Some(l) => l.split('"').next()?.to_string(),
        None if args.iter().any(|a| a == "long") => f.name.replace('_', "-"),
        None => return None,
    };
    let default = args
        .iter()
        .find_map(|a| a.strip_prefix("default_value_t = "));
    Some((format!("--{long}"), default.map(str::to_string)))
}

#[test]
fn tenant_limits() {
    let r = Report::default();
    let src = Src::new(CORE_TENANT);
    let (reference, fields) = src.fields("pub struct TenantLimits");
    let tenant_rows: Vec<&LimitRow> = LIMITS.iter().filter(|l| !l.session_only).collect();
    let table = format!("{HERE} LIMITS");
    let (have, want) = (
        set_of(fields.iter().map(|f| &f.name)),
        set_of(tenant_rows.iter().map(|l| l.key)),
    );
    r.sets("the limits", &reference, &have, &table, &want);
    let defaults = map_of(src.literal("impl Default for TenantLimits", "TenantLimits"));
    let default_of = |key: &str| defaults.get(key).map(|e| number(e));
    let via = |column: &str| format!("{reference} (via LIMITS `{column}` in {HERE})");

    // The table's own conventions: units show in the names.
    for l in LIMITS {
        let ends = |n: Option<&str>, s: &str| n.is_none_or(|n| n.ends_with(s));
        let names = [l.wire, l.policy, l.model];
        let suffixed =
            |n: &&str| n.ends_with("_bytes") || n.ends_with("_mib") || n.ends_with("_seconds");
        let ok = match l.unit {
            Unit::Bytes => {
                ends(l.wire, "_bytes")
                    && [l.policy, l.model].iter().all(|n| ends(*n, "_mib"))
                    && ends(l.cli, "-mib")
            }
            Unit::Seconds => names.iter().all(|n| ends(*n, "_seconds")),
            Unit::Count | Unit::Other => !names.iter().flatten().any(suffixed),
        };
        if !ok {
            r.problem(format!(
                "{table}: `{}` is in {:?}, but a name of it lacks (or wrongly has) the unit suffix \
                 (`_bytes` on the wire, which the Python kernelspec parses as a size; `_mib` in \
                 TOML and flags; `_seconds`)",
                l.key, l.unit
            ));
        }
    }

    // Names in errors: what the host's and the session API's code refuse with, and what the
    // serve error module recognises.
    let mut emitted = Set::new();
    let sources = files_under("crates/core/src", ".rs").into_iter();
    for path in sources.chain(files_under("crates/session-api/src", ".rs")) {
        let code = read_code(&path);
        for (i, _) in code.match_indices("refuse(") {
            let arg = &code[i + "refuse(".len()..];
            if arg.trim_start().starts_with('"')
                && let Some(n) = atom(arg, "")
            {
                emitted.insert(n);
            }
        }
        for (i, _) in code.match_indices("limit max-") {
            let rest = code[i + "limit ".len()..].chars();
            let w: String = rest
                .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                .collect();
            emitted.insert(w.trim_end_matches('-').to_string());
        }
    }
    let refused = |session: bool| -> Set {
        let rows = LIMITS
            .iter()
            .filter(|l| l.refused && (session || !l.session_only));
        set_of(
            rows.filter_map(|l| l.name)
                .chain(HOST_LIMITS.iter().copied()),
        )
    };
    let refused_ref = format!("{table} (`refused`) and HOST_LIMITS");
    let copy = "crates/core/src and crates/session-api/src (`refuse(\"NAME\"`, `(limit NAME)`)";
    r.sets(
        "the limits `resource-exhausted` names",
        &refused_ref,
        &refused(true),
        copy,
        &emitted,
    );
    let src = Src::new(SERVE_ERROR);
    let at = src
        .code
        .find("const LIMITS")
        .unwrap_or_else(|| none_found(SERVE_ERROR, "`const LIMITS`"));
    let names = quoted(block_of(&src.code[at..], "=", '[', SERVE_ERROR));
    let names = set_of(found(names, SERVE_ERROR, "strings of `LIMITS`"));
    let refused_ref = format!("{table} (`refused`, no session-only ones) and HOST_LIMITS");
    let copy = src.label("limit_named_in");
    r.sets(
        "the limits a model's error can name",
        &refused_ref,
        &refused(false),
        &copy,
        &names,
    );
    // Every `max-…` name the session API's docs and client mention is one of them.
    let known = LIMITS
        .iter()
        .filter_map(|l| l.name)
        .chain(HOST_LIMITS.iter().copied());
    let known = set_of(known.chain(PROGRAM_RULES.iter().copied()));
    let mut mentioned = python_modules();
    mentioned.extend([DOCS_NOTEBOOKS.to_string(), SESSION_PROTO.to_string()]);
    for path in &mentioned {
        let unknown: Vec<String> = kebab_limit_names(&read(path))
            .difference(&known)
            .cloned()
            .collect();
        if !unknown.is_empty() {
            r.problem(format!(
                "{path} names limits {unknown:?} that {table} does not know ({known:?})"
            ));
        }
    }

    // The session API: the wire message, its conversions, RequestedLimits, narrowing.
    let wire_ref = via("wire");
    let wire_maps = |what: &str, want: &Map, copy: &str, found: &Map| {
        r.maps(what, &wire_ref, want, copy, found)
    };
    let wire_rows: Vec<&LimitRow> = LIMITS.iter().filter(|l| l.wire.is_some()).collect();
    let wire = |l: &LimitRow| l.wire.unwrap_or_default().to_string();
    let wire_names = set_of(wire_rows.iter().map(|l| wire(l)));
    let wire_col = |f: fn(&LimitRow) -> String| map_of(wire_rows.iter().map(|l| (wire(l), f(l))));
    let src = Src::new(SESSION_PROTO);
    let fields = found(
        proto_fields(src.block("message Limits")),
        &src.path,
        "fields of `message Limits`",
    );
    let proto_types = map_of(fields.into_iter().map(|(t, n)| (n, t)));
    let copy = src.label("message Limits");
    r.sets(
        "the session limits",
        &wire_ref,
        &wire_names,
        &copy,
        &set_of(proto_types.keys()),
    );
    let types = wire_col(|l| {
        if l.unit == Unit::Seconds {
            "double"
        } else {
            "uint64"
        }
        .into()
    });
    // Of the fields both have (a missing one is reported above); a small count may be a
    // `uint32`.
    let types = map_of(types.into_iter().filter_map(|(w, t)| {
        let p = proto_types.get(&w)?;
        let small = t == "uint64" && p == "uint32";
        Some((w, if small { "uint32".into() } else { t }))
    }));
    let proto_types: Map = proto_types
        .into_iter()
        .filter(|(w, _)| wire_names.contains(w))
        .collect();
    wire_maps(
        "field types (seconds: double, the rest unsigned)",
        &types,
        &copy,
        &proto_types,
    );

    let src = Src::new(SESSION_GRPC);
    let not_tenant = "(no TenantLimits field)";
    let fields = src.literal("fn wire_limits(", "Limits");
    let m = map_of(fields.into_iter().map(|(w, e)| {
        (
            w,
            uses(&e, "t.")
                .first()
                .map_or(not_tenant.to_string(), |(_, f)| f.clone()),
        )
    }));
    let want = map_of(wire_rows.iter().map(|l| {
        (
            wire(l),
            if l.session_only { not_tenant } else { l.key }.into(),
        )
    }));
    wire_maps(
        "wire field ← TenantLimits field",
        &want,
        &src.label("fn wire_limits("),
        &m,
    );
    let fields = src.literal("fn requested(", "RequestedLimits {");
    let m = map_of(fields.into_iter().map(|(f, e)| {
        let from: Vec<String> = set_of(uses(&e, "l.").into_iter().map(|(_, w)| w))
            .into_iter()
            .collect();
        (f, from.join(" + "))
    }));
    let identity = wire_col(wire);
    wire_maps(
        "RequestedLimits field ← wire field",
        &identity,
        &src.label("fn requested("),
        &m,
    );

    let policy = Src::new(SESSION_POLICY);
    let (copy, fields) = policy.fields("pub struct RequestedLimits");
    r.sets(
        "the session limits",
        &wire_ref,
        &wire_names,
        &copy,
        &set_of(fields.iter().map(|f| &f.name)),
    );
    // `narrowed`: each requested field is checked under a name and narrows one limit.
    let body = policy.block("pub fn narrowed(");
    let mut named_targets = Map::new();
    for prefix in ["t.", "out."] {
        for (pos, target) in uses(body, prefix) {
            let rest = body[pos + prefix.len() + target.len()..].trim_start();
            if rest.starts_with('=')
                && !rest.starts_with("==")
                && let Some(n) = quoted(&body[pos..]).first()
            {
                named_targets.insert(n.clone(), target);
            }
        }
    }
    let requests = found(uses(body, "r."), &policy.path, "`r.FIELD` in `narrowed`");
    let m = map_of(requests.into_iter().map(|(pos, req)| {
        let name = quoted(&body[..pos]).pop().unwrap_or_else(|| "?".into());
        let target = named_targets.get(&name).map_or("?", String::as_str);
        (req, format!("{target} as `{name}`"))
    }));
    let want = wire_col(|l| format!("{} as `{}`", l.key, l.name.unwrap_or("?")));
    let copy = policy.label("fn narrowed(");
    r.maps(
        "requested field → limit narrowed (its name in errors)",
        &via("name"),
        &want,
        &copy,
        &m,
    );

    // `[tenant.session]` and a model's `[tpubox.limits]`: their keys, and which limit each sets.
    let (copy, fields) = policy.fields("pub struct SessionPolicy");
    let policy_names = set_of(fields.iter().map(|f| &f.name));
    let keys = set_of(LIMITS.iter().filter_map(|l| l.policy));
    r.sets(
        "the `[tenant.session]` keys",
        &via("policy"),
        &keys,
        &copy,
        &policy_names,
    );
    let model = Src::new(SERVE_CONFIG);
    let (copy, fields) = model.fields("pub struct ModelLimits");
    let model_names = set_of(fields.iter().map(|f| &f.name));
    let keys = set_of(LIMITS.iter().filter_map(|l| l.model));
    r.sets(
        "the `[tpubox.limits]` keys",
        &via("model"),
        &keys,
        &copy,
        &model_names,
    );
    type Column = fn(&LimitRow) -> Option<&'static str>;
    let checks: [(&Src, &str, &str, &str, Column); 2] = [
        (&policy, "pub fn limits(", "self.", "policy", |l| l.policy),
        (&model, "pub fn tenant_limits(", "l.", "model", |l| l.model),
    ];
    for (src, marker, prefix, column_name, column) in checks {
        let assigned = limit_assignments(src.block(marker), prefix);
        let assigned = found(
            assigned,
            &src.path,
            &format!("`{prefix}FIELD` in `{marker}`"),
        );
        let m = map_of(assigned.iter().map(|(f, t, _)| (f.clone(), t.clone())));
        // `max_sessions` is checked where a session opens, not turned into a limit; the
        // `tenant_` keys set the tenant's budget (checked below), not a session's limits.
        // `devices` and `exclusive_devices` are placement rules, resolved for all tenants
        // together (`tpubox_core::placement::plan`), not limits of one session.
        let rows = LIMITS.iter().filter(|l| {
            l.key != "max_sessions"
                && !l.key.starts_with("tenant_")
                && !matches!(l.key, "devices" | "exclusive_devices")
        });
        let want = map_of(rows.filter_map(|l| Some((column(l)?.to_string(), l.key.to_string()))));
        r.maps(
            "key → the limit it sets",
            &via(column_name),
            &want,
            &src.label(marker),
            &m,
        );
        for (f, t, conversion) in &assigned {
            if f.ends_with("_mib")
                && !(conversion.contains("mib(") || conversion.contains("1 << 20"))
            {
                let (path, c) = (&src.path, conversion.trim());
                r.problem(format!(
                    "{path}: `{f}` is in MiB but sets `{t}` without converting MiB (`{c}`)"
                ));
            }
        }
    }

    // The tenant's budget: `budget_limits` turns the `tenant_` keys into the budget's limits.
    let marker = "pub fn budget_limits(";
    let assigned = limit_assignments(policy.block(marker), "self.");
    let assigned = found(assigned, &policy.path, "`self.FIELD` in `budget_limits`");
    let m = map_of(assigned.iter().map(|(f, t, _)| (f.clone(), t.clone())));
    let want = map_of(
        [
            ("tenant_max_device_mib", "max_device_bytes"),
            ("tenant_max_running_executions", "max_running_executions"),
            ("tenant_max_per_device_mib", "max_device_bytes_per_device"),
            // The budget's per-device bytes default to one session's.
            ("max_per_device_mib", "max_device_bytes_per_device"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    r.maps(
        "key → the budget limit it sets",
        &format!("{HERE} (the budget's keys)"),
        &want,
        &policy.label(marker),
        &m,
    );

    // The Python client's `Limits` (wherever python/tpubox defines it): the wire names and
    // types, and the limit names its docs give.
    let (py_path, py) = python_module_with("\nclass Limits:");
    let Some((_, _, body)) = py_classes(&py).into_iter().find(|(n, _, _)| n == "Limits") else {
        none_found(&py_path, "`class Limits`")
    };
    let (py_fields, py_docs) = py_limits(&body);
    let _ = found(
        py_fields.keys().collect(),
        &py_path,
        "fields of `class Limits`",
    );
    let types = wire_col(|l| {
        if l.unit == Unit::Seconds {
            "float"
        } else {
            "int"
        }
        .into()
    });
    let copy = format!("{py_path} `Limits`");
    wire_maps(
        "fields and types (seconds: float, the rest int)",
        &types,
        &copy,
        &py_fields,
    );
    for (f, doc) in &py_docs {
        let name = wire_rows
            .iter()
            .find(|l| l.wire == Some(f.as_str()))
            .and_then(|l| l.name);
        for n in kebab_limit_names(doc)
            .into_iter()
            .filter(|n| Some(n.as_str()) != name)
        {
            let want = name.unwrap_or("(nothing)");
            r.problem(format!("{copy} docs call `{f}` ``{n}``, {table} `{want}`"));
        }
    }
    // The kernelspec and the provisioner take `Limits` fields by name.
    let py_names = set_of(py_fields.keys());
    for path in [PY_KERNELSPEC, PY_PROVISIONER] {
        let named = uses(&read(path), "max_")
            .into_iter()
            .map(|(_, w)| format!("max_{w}"));
        let named = set_of(found(named.collect(), path, "`max_…` limit names"));
        let unknown: Vec<&String> = named.difference(&py_names).collect();
        if !unknown.is_empty() {
            r.problem(format!(
                "{path} names limits {unknown:?}, no fields of {copy} ({py_names:?})"
            ));
        }
    }

    // The docs: the `--limit` names, and the TOML examples (both tables refuse unknown keys).
    let text = read(DOCS_NOTEBOOKS);
    let listed = backticked(between(
        &text,
        "named as the fields of",
        ")",
        DOCS_NOTEBOOKS,
    ));
    let listed = set_of(listed.into_iter().filter(|n| n != "tpubox.Limits"));
    let docs = format!("{DOCS_NOTEBOOKS} (`--limit NAME=VALUE`)");
    r.sets("the `--limit` names", &copy, &py_names, &docs, &listed);
    let policy_ref = policy.label("struct SessionPolicy");
    for path in [DOCS_NOTEBOOKS, DOCS_SERVING] {
        for keys in md_toml_keys(&read(path), "tenant.session", path) {
            let docs = format!("{path} (a `[tenant.session]` example)");
            r.sets(
                "the `[tenant.session]` keys",
                &policy_ref,
                &policy_names,
                &docs,
                &keys,
            );
        }
    }
    for keys in md_toml_keys(&read(DOCS_SERVING), "tpubox.limits", DOCS_SERVING) {
        // An example: some keys are enough, but each must exist.
        let unknown: Vec<&String> = keys.difference(&model_names).collect();
        if !unknown.is_empty() {
            r.problem(format!(
                "{DOCS_SERVING} shows `[tpubox.limits]` keys {unknown:?} that {SERVE_CONFIG} \
                 `ModelLimits` lacks ({model_names:?})"
            ));
        }
    }

    // `tpubox run`: which flag sets each limit, with which default.
    let main = Src::new(HOST_MAIN);
    let (_, run_args) = main.fields("struct RunArgs");
    let (mut cli, mut cli_defaults) = (Map::new(), BTreeMap::new());
    for (field, expr) in main.literal("fn run(", "TenantLimits") {
        let flag = uses(&expr, "args.")
            .first()
            .and_then(|(_, a)| flag_of(&run_args, a));
        if let Some((flag, default)) = &flag {
            cli_defaults.insert(field.clone(), (flag.clone(), default.clone()));
        }
        cli.insert(field, flag.map_or("(no flag)".into(), |(f, _)| f));
    }
    let want = map_of(
        tenant_rows
            .iter()
            .map(|l| (l.key.to_string(), l.cli.unwrap_or("(no flag)").into())),
    );
    let copy = format!("{HOST_MAIN} `run` (its `TenantLimits` and `RunArgs`)");
    r.maps("limit ← flag", &via("cli"), &want, &copy, &cli);
    // Its defaults (in the flag's unit) are TenantLimits::default()'s.
    for (field, (flag, default)) in &cli_defaults {
        let unit = if flag.ends_with("-mib") {
            (1u64 << 20) as f64
        } else {
            1.0
        };
        let mib = if unit == 1.0 { "" } else { " MiB" };
        let tenant = format!("{CORE_TENANT} `TenantLimits::default`");
        match (default.as_deref().map(number), default_of(field)) {
            (Some(Ok(c)), Some(Ok(w))) if c.map(|c| c * unit) != w => r.problem(format!(
                "the default of `{field}`: {tenant} says {}, {HOST_MAIN} `{flag}` says {}{mib}",
                shown(w),
                shown(c),
            )),
            (None, Some(Ok(Some(w)))) => r.problem(format!(
                "the default of `{field}`: {tenant} says {w}, {HOST_MAIN} `{flag}` has none"
            )),
            _ => {}
        }
    }

    // The README's limits table: a row per limit, with its error name, flag and default.
    let readme = read(README);
    let mut covered = BTreeSet::new();
    for row in md_table(&readme, "`tpubox run` flag", README) {
        let first = |cell: usize, prefix: &str| {
            let cell = row.get(cell).map_or(String::new(), Clone::clone);
            backticked(&cell)
                .into_iter()
                .find(|t| t.starts_with(prefix))
        };
        let (name, flag) = (first(0, "max-"), first(1, "--"));
        let default = row.get(2).cloned().unwrap_or_default();
        let limit = match &flag {
            Some(f) => LIMITS.iter().find(|l| l.cli == Some(f.as_str())),
            None => LIMITS
                .iter()
                .find(|l| name.is_some() && l.name == name.as_deref()),
        };
        let Some(l) = limit else {
            if !flag
                .as_deref()
                .is_some_and(|f| README_HOST_FLAGS.contains(&f))
            {
                r.problem(format!(
                    "{README}: the limits table's row {row:?} is no limit of {table} (nor in \
                     README_HOST_FLAGS)"
                ));
            }
            continue;
        };
        covered.insert(l.key);
        if let (Some(n), Some(want)) = (&name, l.name)
            && n != want
            && !PROGRAM_RULES.contains(&n.as_str())
        {
            r.problem(format!(
                "{README} names `{}` `{n}`, {table} `{want}`",
                l.key
            ));
        }
        if let (None, Some(cli)) = (&flag, l.cli) {
            r.problem(format!(
                "{README} gives `{}` no flag, {HOST_MAIN} has `{cli}`",
                l.key
            ));
        }
        let (want, source) = match (&flag, cli_defaults.get(l.key), default_of(l.key)) {
            // The flag's own default (not another flag's that sets the same field, as
            // `--trusted` and `--max-loop-iterations` both set `program_policy`).
            (Some(f), Some((cf, d)), _) if f == cf => {
                (d.as_deref().map_or(Ok(None), number), HOST_MAIN)
            }
            (Some(_), _, _) => continue,
            (None, _, Some(d)) => (d, CORE_TENANT),
            _ => continue,
        };
        if let (Ok(a), Ok(b)) = (number(&default), want)
            && a != b
        {
            let k = l.key;
            r.problem(format!(
                "{README} gives `{k}` the default `{default}`, {source} {}",
                shown(b)
            ));
        }
    }
    let missing: Vec<&str> = tenant_rows
        .iter()
        .map(|l| l.key)
        .filter(|k| !covered.contains(k))
        .collect();
    if !missing.is_empty() {
        r.problem(format!(
            "{README}'s limits table has no row for {missing:?} of {reference}"
        ));
    }

    r.finish("tenant limit");
}
