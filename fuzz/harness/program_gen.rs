//! A structure-aware generator of StableHLO programs, for the `programs` fuzz target.
//!
//! It reads an [`arbitrary::Unstructured`] as a sequence of choices and writes a well-typed
//! module in MLIR's generic op syntax (`"stablehlo.add"(%a, %b) : (T, T) -> T`), so that the
//! programs reach XLA's verifier, optimizer and code generator instead of stopping in the
//! parser as random bytes do. It tracks the type of every SSA value it makes, and knows the
//! types of `@main`'s parameters and results, so the harness can create arguments and check
//! what comes back.
//!
//! What it makes, by design the classes a hostile tenant uses:
//! - element-wise unary and binary ops for every element-type class, `compare`, `select`,
//!   `clamp`, `convert`, `bitcast_convert`;
//! - shape ops: `broadcast_in_dim` (also to large shapes: big temporaries), `reshape`,
//!   `transpose`, `slice`, `pad` (negative and interior padding), `concatenate`, `reverse`,
//!   `dynamic_slice` / `dynamic_update_slice` with out-of-range indices, `iota`, `constant`;
//! - `reduce`, `sort`, `dot_general`, `rng_bit_generator`, `optimization_barrier`;
//! - control flow: `while` loops with a known trip count (small, at the tenant's limit, far
//!   above it) or none (a condition that is always true, or compares against a loop-carried
//!   bound), `case` and `if` with regions that capture outer values, nested;
//! - helper functions and `func.call`, and (only when [`GenOptions::allow_recursion`]) a
//!   function that calls itself;
//! - nesting: tuple types nested `depth` deep, `case` regions nested `depth` deep;
//! - host transfers (`infeed`, `outfeed`, `send`, `recv` on tokens) and `custom_call`s;
//! - long plain chains of element-wise ops (compile-time growth);
//! - degenerate shapes: rank 0, zero-sized dimensions, rank up to 6.
//!
//! [`Facts`] records what the program contains, which is what decides the outcome the harness
//! may accept.

use std::fmt::Write;

use arbitrary::{Result, Unstructured};
use tpubox_core::PrimitiveType as P;

/// What the generator may produce.
#[derive(Debug, Clone, Copy)]
pub struct GenOptions {
    /// Emit functions that call themselves (they overflow any compiler stack: only for a host
    /// that compiles in a worker process).
    pub allow_recursion: bool,
    /// Deepest nesting of tuple types and `case` regions.
    pub max_nesting: usize,
    /// Most ops in one program (chains included).
    pub max_ops: u32,
    /// Product of all loop trip counts that may actually run (keeps executions short).
    pub max_executed_trips: u64,
    /// The trip-count limit of the tenant's policy (`max-loop-trips`); loops above it are made
    /// on purpose, to be refused.
    pub policy_max_trips: u64,
}

/// What a generated program contains.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// `infeed`, `outfeed`, `send` or `recv`.
    pub host_transfer: bool,
    /// A `custom_call`.
    pub custom_call: bool,
    /// A `while` whose trip count nothing can prove.
    pub unbounded_loop: bool,
    /// A `while` whose trip count exceeds [`GenOptions::policy_max_trips`].
    pub over_trip_limit: bool,
    /// A function that calls itself.
    pub recursion: bool,
    /// Tuple or region nesting deeper than 64.
    pub deep: bool,
    /// A value with more than 2^16 elements (may exceed the tenant's device bytes).
    pub big: bool,
    /// Deepest nesting reached.
    pub nesting: usize,
    /// Number of ops emitted.
    pub ops: u32,
}

impl Facts {
    /// Whether the program should compile and run for an untrusted tenant with generous
    /// device limits: nothing the policy refuses, nothing that overflows a compiler, nothing
    /// large.
    pub fn clean(&self) -> bool {
        !(self.host_transfer
            || self.custom_call
            || self.unbounded_loop
            || self.over_trip_limit
            || self.recursion
            || self.deep
            || self.big)
    }
}

/// A `tensor<…>` type.
#[derive(Debug, Clone, PartialEq)]
pub struct Ty {
    /// Element type.
    pub et: P,
    /// Dimension sizes.
    pub dims: Vec<i64>,
}

impl Ty {
    fn new(et: P, dims: Vec<i64>) -> Self {
        Ty { et, dims }
    }

    fn scalar(et: P) -> Self {
        Ty { et, dims: vec![] }
    }

    fn with_et(&self, et: P) -> Self {
        Ty::new(et, self.dims.clone())
    }

    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().map(|&d| d as u64).product()
    }

    /// The MLIR spelling, e.g. `tensor<2x3xf32>`.
    pub fn mlir(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            write!(s, "{d}x").unwrap();
        }
        s.push_str(self.et.mlir_name());
        s.push('>');
        s
    }

    fn rank(&self) -> usize {
        self.dims.len()
    }
}

/// A generated module.
#[derive(Debug, Clone)]
pub struct Program {
    /// The MLIR text.
    pub text: String,
    /// `@main`'s parameter types.
    pub params: Vec<Ty>,
    /// `@main`'s result types.
    pub results: Vec<Ty>,
    /// What it contains.
    pub facts: Facts,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Class {
    Float,
    Signed,
    Unsigned,
    Pred,
}

fn class(et: P) -> Class {
    match et {
        P::F16 | P::Bf16 | P::F32 | P::F64 => Class::Float,
        P::S8 | P::S16 | P::S32 | P::S64 => Class::Signed,
        P::U8 | P::U16 | P::U32 | P::U64 => Class::Unsigned,
        _ => Class::Pred,
    }
}

const ETS: &[P] = &[
    P::F32,
    P::F32,
    P::F32,
    P::F64,
    P::F16,
    P::Bf16,
    P::S32,
    P::S32,
    P::S64,
    P::S8,
    P::U8,
    P::U32,
    P::Pred,
];

/// A value in scope.
#[derive(Debug, Clone)]
struct Val {
    name: String,
    ty: Ty,
}

struct Gen<'u, 'a> {
    u: &'u mut Unstructured<'a>,
    opts: GenOptions,
    next: u32,
    funcs: Vec<String>,
    facts: Facts,
    /// Product of the trip counts of the loops being generated (that may run).
    trips: u64,
    /// Inside a loop body (no big shapes there: they would run many times).
    in_loop: bool,
    depth: usize,
}

/// Generates one program from `u`. Errors only when `u` cannot be read (never in practice:
/// an exhausted `Unstructured` yields zeros).
pub fn generate(u: &mut Unstructured, opts: GenOptions) -> Result<Program> {
    let mut g = Gen {
        u,
        opts,
        next: 0,
        funcs: Vec::new(),
        facts: Facts::default(),
        trips: 1,
        in_loop: false,
        depth: 0,
    };
    let n_params = g.u.int_in_range(0..=3)?;
    let mut scope = Vec::new();
    let mut params = Vec::new();
    for _ in 0..n_params {
        let ty = g.small_ty()?;
        let name = g.fresh();
        params.push(ty.clone());
        scope.push(Val { name, ty });
    }
    let mut body = String::new();
    let n_ops = g.u.int_in_range(1..=24)?;
    for _ in 0..n_ops {
        if g.facts.ops >= g.opts.max_ops {
            break;
        }
        g.op(&mut scope, &mut body, 2)?;
    }
    if scope.is_empty() {
        let ty = g.small_ty()?;
        let v = g.constant(&ty, &mut body, 2)?;
        scope.push(v);
    }
    // Results: mostly the newest values, sometimes older ones.
    let n_results = g.u.int_in_range(1..=3)?.min(scope.len());
    let mut results = Vec::new();
    for i in 0..n_results {
        let v = if g.u.ratio(3, 4)? {
            scope[scope.len() - 1 - i].clone()
        } else {
            g.u.choose(&scope)?.clone()
        };
        results.push(v);
    }
    let mut text = String::from("module @fuzz {\n");
    for f in &g.funcs {
        text.push_str(f);
    }
    let sig: Vec<String> = scope[..n_params as usize]
        .iter()
        .map(|v| format!("{}: {}", v.name, v.ty.mlir()))
        .collect();
    let rtys: Vec<String> = results.iter().map(|v| v.ty.mlir()).collect();
    writeln!(
        text,
        "  func.func public @main({}) -> ({}) {{",
        sig.join(", "),
        rtys.join(", ")
    )
    .unwrap();
    text.push_str(&body);
    writeln!(
        text,
        "    \"func.return\"({}) : ({}) -> ()\n  }}\n}}",
        results
            .iter()
            .map(|v| v.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        rtys.join(", ")
    )
    .unwrap();
    Ok(Program {
        text,
        params,
        results: results.into_iter().map(|v| v.ty).collect(),
        facts: g.facts,
    })
}

fn pad(indent: usize) -> String {
    "  ".repeat(indent)
}

/// A dense i64 array attribute: `array<i64: 1, 2>`, or `array<i64>` when empty.
fn arr(xs: &[i64]) -> String {
    if xs.is_empty() {
        "array<i64>".into()
    } else {
        format!("array<i64: {}>", list(xs))
    }
}

fn list(xs: &[i64]) -> String {
    xs.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Gen<'_, '_> {
    fn fresh(&mut self) -> String {
        self.next += 1;
        format!("%v{}", self.next)
    }

    fn et(&mut self) -> Result<P> {
        Ok(*self.u.choose(ETS)?)
    }

    fn small_dim(&mut self) -> Result<i64> {
        Ok(*self.u.choose(&[0, 1, 1, 2, 2, 3, 3, 4, 5, 8, 16])?)
    }

    /// A type of at most 4096 elements (parameters, loop bodies).
    fn small_ty(&mut self) -> Result<Ty> {
        let et = self.et()?;
        let rank = *self.u.choose(&[0, 1, 1, 2, 2, 2, 3, 4, 6])?;
        let mut dims = Vec::new();
        for _ in 0..rank {
            dims.push(self.small_dim()?);
        }
        let mut ty = Ty::new(et, dims);
        while ty.elems() > 4096 {
            let i = ty.dims.iter().position(|&d| d > 1).unwrap();
            ty.dims[i] = 1;
        }
        Ok(ty)
    }

    /// A dimension for a new (broadcast) value: sometimes large, outside loops.
    fn new_dim(&mut self) -> Result<i64> {
        if !self.in_loop && self.u.ratio(1, 12)? {
            Ok(*self.u.choose(&[1000, 4096, 30000, 65536])?)
        } else {
            self.small_dim()
        }
    }

    fn note_size(&mut self, ty: &Ty) {
        if ty.elems() > 1 << 16 {
            self.facts.big = true;
        }
    }

    fn emit(&mut self, out: &mut String, indent: usize, line: &str) {
        self.facts.ops += 1;
        writeln!(out, "{}{line}", pad(indent)).unwrap();
    }

    /// Some value of scope satisfying `ok`, if any.
    fn pick(&mut self, scope: &[Val], ok: impl Fn(&Ty) -> bool) -> Result<Option<Val>> {
        let c: Vec<&Val> = scope.iter().filter(|v| ok(&v.ty)).collect();
        if c.is_empty() {
            return Ok(None);
        }
        // Prefer recent values, so programs form chains rather than fans.
        let i = if self.u.ratio(2, 3)? {
            c.len() - 1 - (self.u.int_in_range(0..=2)? as usize).min(c.len() - 1)
        } else {
            self.u.choose_index(c.len())?
        };
        Ok(Some(c[i].clone()))
    }

    /// A value of exactly `ty`: one in scope, or a new constant.
    fn value_of(&mut self, scope: &[Val], ty: &Ty, out: &mut String, ind: usize) -> Result<Val> {
        if self.u.ratio(3, 4)?
            && let Some(v) = self.pick(scope, |t| t == ty)?
        {
            return Ok(v);
        }
        self.constant(ty, out, ind)
    }

    /// Some value: one in scope (mostly), or a new constant.
    fn any_value(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        if !scope.is_empty() && self.u.ratio(7, 8)? {
            return Ok(self.pick(scope, |_| true)?.unwrap());
        }
        let ty = self.small_ty()?;
        self.constant(&ty, out, ind)
    }

    fn literal(&mut self, et: P) -> Result<String> {
        Ok(match class(et) {
            Class::Float => {
                let vals: &[&str] = if et == P::F16 {
                    &["0.0", "1.0", "-2.5", "0.125", "65504.0", "-0.0"]
                } else {
                    &["0.0", "1.0", "-2.5", "0.125", "1.0e+30", "-0.0", "3.5"]
                };
                self.u.choose(vals)?.to_string()
            }
            Class::Signed => self
                .u
                .choose(&["0", "1", "-1", "7", "-128", "127"])?
                .to_string(),
            Class::Unsigned => self.u.choose(&["0", "1", "7", "255"])?.to_string(),
            Class::Pred => self.u.choose(&["true", "false"])?.to_string(),
        })
    }

    fn constant(&mut self, ty: &Ty, out: &mut String, ind: usize) -> Result<Val> {
        let lit = self.literal(ty.et)?;
        let name = self.fresh();
        let t = ty.mlir();
        self.note_size(ty);
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"stablehlo.constant\"() {{value = dense<{lit}> : {t}}} : () -> {t}"
            ),
        );
        Ok(Val {
            name,
            ty: ty.clone(),
        })
    }

    fn scalar_const(&mut self, et: P, lit: &str, out: &mut String, ind: usize) -> Val {
        let name = self.fresh();
        let t = Ty::scalar(et).mlir();
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"stablehlo.constant\"() {{value = dense<{lit}> : {t}}} : () -> {t}"
            ),
        );
        Val {
            name,
            ty: Ty::scalar(et),
        }
    }

    /// Emits `name = "op"(args) {attrs} : (arg types) -> result` and returns the new value.
    fn simple(
        &mut self,
        out: &mut String,
        ind: usize,
        op: &str,
        args: &[&Val],
        attrs: &str,
        result: Ty,
    ) -> Val {
        let name = self.fresh();
        let a: Vec<&str> = args.iter().map(|v| v.name.as_str()).collect();
        let t: Vec<String> = args.iter().map(|v| v.ty.mlir()).collect();
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{attrs}}}")
        };
        self.note_size(&result);
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"stablehlo.{op}\"({}){attrs} : ({}) -> {}",
                a.join(", "),
                t.join(", "),
                result.mlir()
            ),
        );
        Val { name, ty: result }
    }

    /// One op (or one structured group of ops) appended to `out`; its result joins `scope`.
    fn op(&mut self, scope: &mut Vec<Val>, out: &mut String, ind: usize) -> Result<()> {
        let kind = self.u.int_in_range(0..=33u8)?;
        let v = match kind {
            0..=2 => self.unary(scope, out, ind)?,
            3..=6 => self.binary(scope, out, ind)?,
            7 => self.compare_select(scope, out, ind)?,
            8 => self.convert(scope, out, ind)?,
            9 => self.broadcast(scope, out, ind)?,
            10 => self.reshape(scope, out, ind)?,
            11 => self.transpose(scope, out, ind)?,
            12 => self.reduce(scope, out, ind)?,
            13 => self.slice(scope, out, ind)?,
            14 => self.pad_op(scope, out, ind)?,
            15 => self.concat_reverse(scope, out, ind)?,
            16 => self.dynamic_slice(scope, out, ind)?,
            17 => self.dot(scope, out, ind)?,
            18 => self.sort(scope, out, ind)?,
            19 | 20 => self.while_loop(scope, out, ind)?,
            21 | 22 => self.case_if(scope, out, ind)?,
            23 => self.call(scope, out, ind)?,
            24 => self.nested_tuple(scope, out, ind)?,
            25 => self.nested_case(scope, out, ind)?,
            26 if self.u.ratio(1, 3)? => self.host_transfer(scope, out, ind)?,
            27 if self.u.ratio(1, 3)? => self.custom_call(scope, out, ind)?,
            28 => self.chain(scope, out, ind)?,
            29 => self.iota(out, ind)?,
            30 => self.clamp_bitcast(scope, out, ind)?,
            31 => self.rng(out, ind)?,
            32 => {
                let x = self.any_value(scope, out, ind)?;
                let ty = x.ty.clone();
                self.simple(out, ind, "optimization_barrier", &[&x], "", ty)
            }
            _ => {
                let ty = self.small_ty()?;
                self.constant(&ty, out, ind)?
            }
        };
        scope.push(v);
        Ok(())
    }

    fn unary(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let (ops, is_finite): (&[&str], bool) = match class(x.ty.et) {
            Class::Float => (
                &[
                    "abs",
                    "negate",
                    "exponential",
                    "log",
                    "tanh",
                    "sqrt",
                    "rsqrt",
                    "floor",
                    "ceil",
                    "sign",
                    "cosine",
                    "sine",
                    "tan",
                    "logistic",
                    "exponential_minus_one",
                    "log_plus_one",
                    "cbrt",
                    "round_nearest_even",
                    "round_nearest_afz",
                    "is_finite",
                ],
                true,
            ),
            Class::Signed => (
                &[
                    "abs",
                    "negate",
                    "not",
                    "popcnt",
                    "count_leading_zeros",
                    "sign",
                ],
                false,
            ),
            Class::Unsigned => (&["not", "popcnt", "count_leading_zeros"], false),
            Class::Pred => (&["not"], false),
        };
        let op = *self.u.choose(ops)?;
        let ty = if is_finite && op == "is_finite" {
            x.ty.with_et(P::Pred)
        } else {
            x.ty.clone()
        };
        Ok(self.simple(out, ind, op, &[&x], "", ty))
    }

    fn binary_op(&mut self, et: P) -> Result<&'static str> {
        Ok(match class(et) {
            Class::Float => *self.u.choose(&[
                "add",
                "subtract",
                "multiply",
                "divide",
                "remainder",
                "maximum",
                "minimum",
                "power",
                "atan2",
            ])?,
            Class::Signed | Class::Unsigned => *self.u.choose(&[
                "add",
                "subtract",
                "multiply",
                "divide",
                "remainder",
                "maximum",
                "minimum",
                "and",
                "or",
                "xor",
                "shift_left",
                "shift_right_logical",
                "shift_right_arithmetic",
                "power",
            ])?,
            Class::Pred => *self.u.choose(&["and", "or", "xor"])?,
        })
    }

    fn binary(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let y = self.value_of(scope, &x.ty, out, ind)?;
        let op = self.binary_op(x.ty.et)?;
        let ty = x.ty.clone();
        Ok(self.simple(out, ind, op, &[&x, &y], "", ty))
    }

    fn compare(&mut self, x: &Val, y: &Val, out: &mut String, ind: usize) -> Result<Val> {
        let dir = *self.u.choose(&["EQ", "NE", "LT", "LE", "GT", "GE"])?;
        let ty = x.ty.with_et(P::Pred);
        Ok(self.simple(
            out,
            ind,
            "compare",
            &[x, y],
            &format!("comparison_direction = #stablehlo<comparison_direction {dir}>"),
            ty,
        ))
    }

    fn compare_select(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let y = self.value_of(scope, &x.ty, out, ind)?;
        let p = self.compare(&x, &y, out, ind)?;
        if self.u.ratio(1, 3)? {
            return Ok(p);
        }
        let ty = x.ty.clone();
        Ok(self.simple(out, ind, "select", &[&p, &x, &y], "", ty))
    }

    fn convert(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let et = self.et()?;
        let ty = x.ty.with_et(et);
        Ok(self.simple(out, ind, "convert", &[&x], "", ty))
    }

    fn broadcast(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let extra = self.u.int_in_range(0..=2)?;
        let rank = (x.ty.rank() + extra).min(6);
        // Result positions of x's dims: increasing, chosen among `rank`.
        let mut positions: Vec<usize> = (0..rank).collect();
        while positions.len() > x.ty.rank() {
            let i = self.u.choose_index(positions.len())?;
            positions.remove(i);
        }
        let mut dims = vec![0i64; rank];
        let mut filled = vec![false; rank];
        for (i, &p) in positions.iter().enumerate() {
            let d = x.ty.dims[i];
            dims[p] = if d == 1 { self.new_dim()? } else { d };
            filled[p] = true;
        }
        for p in 0..rank {
            if !filled[p] {
                dims[p] = self.new_dim()?;
            }
        }
        let mut ty = Ty::new(x.ty.et, dims);
        // Keep the largest shapes within 2^24 elements (the compiler folds some constants).
        while ty.elems() > 1 << 24 {
            let p = (0..rank).find(|&p| !filled[p] && ty.dims[p] > 1);
            match p {
                Some(p) => ty.dims[p] = 1,
                None => return Ok(x),
            }
        }
        let pos: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        Ok(self.simple(
            out,
            ind,
            "broadcast_in_dim",
            &[&x],
            &format!("broadcast_dimensions = {}", arr(&pos)),
            ty,
        ))
    }

    fn reshape(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let n = x.ty.elems() as i64;
        let mut rev = x.ty.dims.clone();
        rev.reverse();
        let options = [vec![n], vec![1, n], vec![n, 1], rev, vec![]];
        let mut dims = self.u.choose(&options)?.clone();
        if dims.is_empty() && n != 1 {
            dims = vec![n];
        }
        let ty = Ty::new(x.ty.et, dims);
        Ok(self.simple(out, ind, "reshape", &[&x], "", ty))
    }

    fn transpose(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let mut perm: Vec<usize> = (0..x.ty.rank()).collect();
        for i in (1..perm.len()).rev() {
            let j = self.u.int_in_range(0..=i)?;
            perm.swap(i, j);
        }
        let dims = perm.iter().map(|&p| x.ty.dims[p]).collect();
        let perm: Vec<i64> = perm.iter().map(|&p| p as i64).collect();
        let ty = Ty::new(x.ty.et, dims);
        Ok(self.simple(
            out,
            ind,
            "transpose",
            &[&x],
            &format!("permutation = {}", arr(&perm)),
            ty,
        ))
    }

    /// A one-op region body `^bb0(%a: tensor<et>, %b: tensor<et>): ...` applying `op`.
    fn scalar_region(&mut self, et: P, op: &str, ind: usize) -> String {
        let a = self.fresh();
        let b = self.fresh();
        let r = self.fresh();
        let t = Ty::scalar(et).mlir();
        let p = pad(ind + 1);
        self.facts.ops += 2;
        format!(
            "{{\n{p}^bb0({a}: {t}, {b}: {t}):\n{p}  {r} = \"stablehlo.{op}\"({a}, {b}) : ({t}, {t}) -> {t}\n{p}  \"stablehlo.return\"({r}) : ({t}) -> ()\n{p}}}"
        )
    }

    fn reduce(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let et = x.ty.et;
        let (op, init) = match class(et) {
            Class::Pred => (*self.u.choose(&["and", "or"])?, "true".to_string()),
            _ => {
                let op = *self.u.choose(&["add", "maximum", "minimum", "multiply"])?;
                (op, self.literal(et)?)
            }
        };
        let init = self.scalar_const(et, &init, out, ind);
        let mut dims = Vec::new();
        let mut kept = Vec::new();
        for (i, &d) in x.ty.dims.iter().enumerate() {
            if self.u.ratio(1, 2)? {
                dims.push(i as i64);
            } else {
                kept.push(d);
            }
        }
        let region = self.scalar_region(et, op, ind);
        let name = self.fresh();
        let ty = Ty::new(et, kept);
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"stablehlo.reduce\"({}, {}) ({region}) {{dimensions = {}}} : ({}, {}) -> {}",
                x.name,
                init.name,
                arr(&dims),
                x.ty.mlir(),
                init.ty.mlir(),
                ty.mlir()
            ),
        );
        Ok(Val { name, ty })
    }

    fn slice(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let (mut start, mut limit, mut stride, mut dims) = (vec![], vec![], vec![], vec![]);
        for &d in &x.ty.dims {
            let s = self.u.int_in_range(0..=d)?;
            let l = self.u.int_in_range(s..=d)?;
            let st = self.u.int_in_range(1..=3)?;
            start.push(s);
            limit.push(l);
            stride.push(st);
            dims.push((l - s + st - 1) / st);
        }
        let ty = Ty::new(x.ty.et, dims);
        Ok(self.simple(
            out,
            ind,
            "slice",
            &[&x],
            &format!(
                "start_indices = {}, limit_indices = {}, strides = {}",
                arr(&start),
                arr(&limit),
                arr(&stride)
            ),
            ty,
        ))
    }

    fn pad_op(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let lit = self.literal(x.ty.et)?;
        let pv = self.scalar_const(x.ty.et, &lit, out, ind);
        let (mut lo, mut hi, mut inner, mut dims) = (vec![], vec![], vec![], vec![]);
        for &d in &x.ty.dims {
            let i = if d > 1 {
                self.u.int_in_range(0..=2)?
            } else {
                0
            };
            let base = d + (d - 1).max(0) * i;
            let l = self.u.int_in_range(-1..=2)?.max(-base);
            let h = self.u.int_in_range(-1..=2)?.max(-(base + l));
            lo.push(l);
            hi.push(h);
            inner.push(i);
            dims.push(base + l + h);
        }
        let ty = Ty::new(x.ty.et, dims);
        Ok(self.simple(
            out,
            ind,
            "pad",
            &[&x, &pv],
            &format!(
                "edge_padding_low = {}, edge_padding_high = {}, interior_padding = {}",
                arr(&lo),
                arr(&hi),
                arr(&inner)
            ),
            ty,
        ))
    }

    fn concat_reverse(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        if x.ty.rank() == 0 {
            return Ok(x);
        }
        let d = self.u.choose_index(x.ty.rank())?;
        if self.u.ratio(1, 2)? {
            let ty = x.ty.clone();
            return Ok(self.simple(
                out,
                ind,
                "reverse",
                &[&x],
                &format!("dimensions = array<i64: {d}>"),
                ty,
            ));
        }
        let mut dims = x.ty.dims.clone();
        dims[d] *= 2;
        let ty = Ty::new(x.ty.et, dims);
        Ok(self.simple(
            out,
            ind,
            "concatenate",
            &[&x, &x],
            &format!("dimension = {d} : i64"),
            ty,
        ))
    }

    fn dynamic_slice(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let mut idx = Vec::new();
        let mut sizes = Vec::new();
        for &d in &x.ty.dims {
            let lit = *self
                .u
                .choose(&["0", "1", "-1", "2147483647", "-2147483648", "3"])?;
            idx.push(self.scalar_const(P::S32, lit, out, ind));
            sizes.push(self.u.int_in_range(0..=d)?);
        }
        let mut args = vec![&x];
        args.extend(idx.iter());
        if self.u.ratio(1, 2)? {
            let ty = Ty::new(x.ty.et, sizes.clone());
            return Ok(self.simple(
                out,
                ind,
                "dynamic_slice",
                &args,
                &format!("slice_sizes = {}", arr(&sizes)),
                ty,
            ));
        }
        let upd_ty = Ty::new(x.ty.et, sizes);
        let upd = self.value_of(scope, &upd_ty, out, ind)?;
        let mut args = vec![&x, &upd];
        args.extend(idx.iter());
        let ty = x.ty.clone();
        Ok(self.simple(out, ind, "dynamic_update_slice", &args, "", ty))
    }

    fn dot(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let numeric = |t: &Ty| t.rank() == 2 && matches!(class(t.et), Class::Float | Class::Signed);
        let x = match self.pick(scope, numeric)? {
            Some(x) => x,
            None => {
                let m = self.new_dim()?;
                let k = self.small_dim()?;
                let ty = Ty::new(P::F32, vec![m, k]);
                self.constant(&ty, out, ind)?
            }
        };
        let n = self.new_dim()?;
        let yt = Ty::new(x.ty.et, vec![x.ty.dims[1], n]);
        let y = self.value_of(scope, &yt, out, ind)?;
        let ty = Ty::new(x.ty.et, vec![x.ty.dims[0], n]);
        if ty.elems() > 1 << 24 {
            return Ok(x);
        }
        Ok(self.simple(
            out,
            ind,
            "dot_general",
            &[&x, &y],
            "dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>",
            ty,
        ))
    }

    fn sort(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        if x.ty.rank() == 0 || x.ty.et == P::Pred {
            return Ok(x);
        }
        let d = self.u.choose_index(x.ty.rank())?;
        let dir = *self.u.choose(&["LT", "GT"])?;
        let a = self.fresh();
        let b = self.fresh();
        let c = self.fresh();
        let t = Ty::scalar(x.ty.et).mlir();
        let p = pad(ind + 1);
        let name = self.fresh();
        let stable = self.u.ratio(1, 2)?;
        self.facts.ops += 2;
        self.note_size(&x.ty);
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"stablehlo.sort\"({}) ({{\n{p}^bb0({a}: {t}, {b}: {t}):\n{p}  {c} = \"stablehlo.compare\"({a}, {b}) {{comparison_direction = #stablehlo<comparison_direction {dir}>}} : ({t}, {t}) -> tensor<i1>\n{p}  \"stablehlo.return\"({c}) : (tensor<i1>) -> ()\n{p}}}) {{dimension = {d} : i64, is_stable = {}}} : ({}) -> {}",
                x.name,
                stable,
                x.ty.mlir(),
                x.ty.mlir()
            ),
        );
        Ok(Val {
            name,
            ty: x.ty.clone(),
        })
    }

    /// The ops of a nested block: `n` ops on a copy of `scope`, then a value of type `want`.
    fn block_yielding(
        &mut self,
        scope: &[Val],
        want: &Ty,
        out: &mut String,
        ind: usize,
    ) -> Result<Val> {
        let mut inner = scope.to_vec();
        let n = self.u.int_in_range(0..=4)?;
        self.depth += 1;
        self.facts.nesting = self.facts.nesting.max(self.depth);
        for _ in 0..n {
            if self.facts.ops >= self.opts.max_ops || self.depth > 6 {
                break;
            }
            self.op(&mut inner, out, ind)?;
        }
        self.depth -= 1;
        // The newest value of the wanted type, or a constant.
        let newest = inner.iter().rev().find(|v| &v.ty == want).cloned();
        match newest {
            Some(v) if self.u.ratio(7, 8)? => Ok(v),
            _ => self.constant(want, out, ind),
        }
    }

    fn while_loop(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        // The trip count: small, at the policy limit, above it, or unknowable.
        let room = self.opts.max_executed_trips / self.trips.max(1);
        let kind = self.u.int_in_range(0..=9u8)?;
        let (trips, bounded) = match kind {
            0..=5 => (self.u.int_in_range(0..=room.clamp(0, 40))?, true),
            6 => (room.min(self.opts.policy_max_trips), true),
            7 => (
                *self
                    .u
                    .choose(&[self.opts.policy_max_trips + 1, 1 << 40, i64::MAX as u64])?,
                true,
            ),
            _ => (0, false),
        };
        let will_run_long = !bounded || trips > room;
        if !bounded {
            self.facts.unbounded_loop = true;
        } else if trips > self.opts.policy_max_trips {
            self.facts.over_trip_limit = true;
        }
        let i0 = self.scalar_const(P::S64, "0", out, ind);
        let name = self.fresh();
        let ci = self.fresh();
        let cx = self.fresh();
        let bi = self.fresh();
        let bx = self.fresh();
        let xt = x.ty.mlir();
        let p = pad(ind + 1);
        // Condition region.
        let mut cond = String::new();
        let cmp = self.fresh();
        if bounded {
            let lim = self.scalar_const(P::S64, &trips.to_string(), &mut cond, ind + 2);
            writeln!(
                cond,
                "{p}  {cmp} = \"stablehlo.compare\"({ci}, {}) {{comparison_direction = #stablehlo<comparison_direction LT>}} : (tensor<i64>, tensor<i64>) -> tensor<i1>",
                lim.name
            )
            .unwrap();
        } else if self.u.ratio(1, 2)? {
            writeln!(
                cond,
                "{p}  {cmp} = \"stablehlo.constant\"() {{value = dense<true> : tensor<i1>}} : () -> tensor<i1>"
            )
            .unwrap();
        } else {
            // i < i + 1: true until the counter wraps, which takes 2^63 trips.
            let one = self.scalar_const(P::S64, "1", &mut cond, ind + 2);
            let nxt = self.fresh();
            writeln!(
                cond,
                "{p}  {nxt} = \"stablehlo.add\"({ci}, {}) : (tensor<i64>, tensor<i64>) -> tensor<i64>\n{p}  {cmp} = \"stablehlo.compare\"({ci}, {nxt}) {{comparison_direction = #stablehlo<comparison_direction LT>}} : (tensor<i64>, tensor<i64>) -> tensor<i1>",
                one.name
            )
            .unwrap();
        }
        // Body region: the counter steps by one; the carried value goes through a few ops.
        let mut body = String::new();
        let saved = (self.trips, self.in_loop);
        self.trips = self.trips.saturating_mul(if will_run_long {
            u64::MAX
        } else {
            trips.max(1)
        });
        self.in_loop = true;
        let body_scope = vec![Val {
            name: bx.clone(),
            ty: x.ty.clone(),
        }];
        let nx = self.block_yielding(&body_scope, &x.ty, &mut body, ind + 2)?;
        (self.trips, self.in_loop) = saved;
        let one = self.scalar_const(P::S64, "1", &mut body, ind + 2);
        let ni = self.fresh();
        writeln!(
            body,
            "{p}  {ni} = \"stablehlo.add\"({bi}, {}) : (tensor<i64>, tensor<i64>) -> tensor<i64>",
            one.name
        )
        .unwrap();
        self.emit(
            out,
            ind,
            &format!(
                "{name}:2 = \"stablehlo.while\"({}, {}) ({{\n{p}^bb0({ci}: tensor<i64>, {cx}: {xt}):\n{cond}{p}  \"stablehlo.return\"({cmp}) : (tensor<i1>) -> ()\n{p}}}, {{\n{p}^bb0({bi}: tensor<i64>, {bx}: {xt}):\n{body}{p}  \"stablehlo.return\"({ni}, {}) : (tensor<i64>, {xt}) -> ()\n{p}}}) : (tensor<i64>, {xt}) -> (tensor<i64>, {xt})",
                i0.name, x.name, nx.name
            ),
        );
        let _ = cx;
        Ok(Val {
            name: format!("{name}#1"),
            ty: x.ty.clone(),
        })
    }

    fn case_if(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let want = match self.pick(scope, |_| true)? {
            Some(v) => v.ty,
            None => self.small_ty()?,
        };
        let is_if = self.u.ratio(1, 2)?;
        let (sel, n) = if is_if {
            let lit = self.literal(P::Pred)?;
            (self.scalar_const(P::Pred, &lit, out, ind), 2)
        } else {
            let lit = *self.u.choose(&["0", "1", "2", "-1", "7"])?;
            let n = self.u.int_in_range(1..=3)?;
            (self.scalar_const(P::S32, lit, out, ind), n)
        };
        let p = pad(ind + 1);
        let wt = want.mlir();
        let mut regions = Vec::new();
        for _ in 0..n {
            let mut r = String::new();
            let v = self.block_yielding(scope, &want, &mut r, ind + 2)?;
            regions.push(format!(
                "{{\n{r}{p}  \"stablehlo.return\"({}) : ({wt}) -> ()\n{p}}}",
                v.name
            ));
        }
        let name = self.fresh();
        let op = if is_if { "if" } else { "case" };
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"stablehlo.{op}\"({}) ({}) : ({}) -> {wt}",
                sel.name,
                regions.join(", "),
                sel.ty.mlir()
            ),
        );
        Ok(Val { name, ty: want })
    }

    fn call(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        if self.depth > 2 || self.funcs.len() >= 4 {
            return self.any_value(scope, out, ind);
        }
        let n = self.u.int_in_range(1..=2)?;
        let mut args = Vec::new();
        for _ in 0..n {
            args.push(self.any_value(scope, out, ind)?);
        }
        self.next += 1;
        let fname = format!("@f{}", self.next);
        let mut params = Vec::new();
        for a in &args {
            let name = self.fresh();
            params.push(Val {
                name,
                ty: a.ty.clone(),
            });
        }
        let rty = args[0].ty.clone();
        let mut body = String::new();
        let mut inner = params.clone();
        let recursive = self.opts.allow_recursion && self.u.ratio(1, 3)?;
        if recursive {
            self.facts.recursion = true;
            let r = self.fresh();
            let a: Vec<&str> = params.iter().map(|v| v.name.as_str()).collect();
            let t: Vec<String> = params.iter().map(|v| v.ty.mlir()).collect();
            self.emit(
                &mut body,
                2,
                &format!(
                    "{r} = \"func.call\"({}) {{callee = {fname}}} : ({}) -> {}",
                    a.join(", "),
                    t.join(", "),
                    rty.mlir()
                ),
            );
            inner.push(Val {
                name: r,
                ty: rty.clone(),
            });
        }
        self.depth += 1;
        let ret = self.block_yielding(&inner, &rty, &mut body, 2)?;
        self.depth -= 1;
        let sig: Vec<String> = params
            .iter()
            .map(|v| format!("{}: {}", v.name, v.ty.mlir()))
            .collect();
        let mut f = String::new();
        writeln!(
            f,
            "  func.func private {fname}({}) -> {} {{\n{body}    \"func.return\"({}) : ({}) -> ()\n  }}",
            sig.join(", "),
            rty.mlir(),
            ret.name,
            rty.mlir()
        )
        .unwrap();
        self.funcs.push(f);
        let name = self.fresh();
        let a: Vec<&str> = args.iter().map(|v| v.name.as_str()).collect();
        let t: Vec<String> = args.iter().map(|v| v.ty.mlir()).collect();
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"func.call\"({}) {{callee = {fname}}} : ({}) -> {}",
                a.join(", "),
                t.join(", "),
                rty.mlir()
            ),
        );
        Ok(Val { name, ty: rty })
    }

    fn nesting_depth(&mut self) -> Result<usize> {
        let max = self.opts.max_nesting.max(1);
        let d = if self.u.ratio(1, 4)? {
            self.u.int_in_range(1..=max)?
        } else {
            self.u.int_in_range(1..=max.min(8))?
        };
        self.facts.nesting = self.facts.nesting.max(d);
        if d > 64 {
            self.facts.deep = true;
        }
        Ok(d)
    }

    fn nested_tuple(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let depth = self.nesting_depth()?;
        let mut cur = x.clone();
        let mut ty = x.ty.mlir();
        let mut types = Vec::new();
        for _ in 0..depth {
            let inner_ty = ty.clone();
            ty = format!("tuple<{inner_ty}>");
            let name = self.fresh();
            self.emit(
                out,
                ind,
                &format!(
                    "{name} = \"stablehlo.tuple\"({}) : ({inner_ty}) -> {ty}",
                    cur.name
                ),
            );
            types.push(inner_ty);
            cur = Val {
                name,
                ty: x.ty.clone(),
            };
        }
        for inner_ty in types.into_iter().rev() {
            let name = self.fresh();
            self.emit(
                out,
                ind,
                &format!(
                    "{name} = \"stablehlo.get_tuple_element\"({}) {{index = 0 : i32}} : ({ty}) -> {inner_ty}",
                    cur.name
                ),
            );
            ty = inner_ty;
            cur = Val {
                name,
                ty: x.ty.clone(),
            };
        }
        Ok(cur)
    }

    fn nested_case(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let depth = self.nesting_depth()?;
        let idx = self.scalar_const(P::S32, "0", out, ind);
        let t = x.ty.mlir();
        // Built inside out: the innermost region returns x.
        let mut inner = format!("\"stablehlo.return\"({}) : ({t}) -> ()", x.name);
        for _ in 0..depth {
            let name = self.fresh();
            self.facts.ops += 2;
            inner = format!(
                "{name} = \"stablehlo.case\"({}) ({{\n{inner}\n}}) : (tensor<i32>) -> {t}\n\"stablehlo.return\"({name}) : ({t}) -> ()",
                idx.name
            );
        }
        // Peel the last return off: the outermost case is the value.
        let cut = inner.rfind("\n\"stablehlo.return\"").unwrap();
        let body = &inner[..cut];
        let name = body.split(' ').next().unwrap().to_string();
        writeln!(out, "{body}").unwrap();
        Ok(Val { name, ty: x.ty })
    }

    fn token(&mut self, out: &mut String, ind: usize) -> String {
        let t = self.fresh();
        self.emit(
            out,
            ind,
            &format!("{t} = \"stablehlo.after_all\"() : () -> !stablehlo.token"),
        );
        t
    }

    fn host_transfer(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        self.facts.host_transfer = true;
        let tok = self.token(out, ind);
        let x = self.any_value(scope, out, ind)?;
        let t = x.ty.mlir();
        let name = self.fresh();
        match self.u.int_in_range(0..=3u8)? {
            0 => {
                self.emit(
                    out,
                    ind,
                    &format!(
                        "{name}:2 = \"stablehlo.infeed\"({tok}) {{infeed_config = \"\"}} : (!stablehlo.token) -> ({t}, !stablehlo.token)"
                    ),
                );
                Ok(Val {
                    name: format!("{name}#0"),
                    ty: x.ty,
                })
            }
            1 => {
                self.emit(
                    out,
                    ind,
                    &format!(
                        "{name} = \"stablehlo.outfeed\"({}, {tok}) {{outfeed_config = \"\"}} : ({t}, !stablehlo.token) -> !stablehlo.token",
                        x.name
                    ),
                );
                Ok(x)
            }
            2 => {
                self.emit(
                    out,
                    ind,
                    &format!(
                        "{name} = \"stablehlo.send\"({}, {tok}) {{channel_handle = #stablehlo.channel_handle<handle = 1, type = 2>, is_host_transfer = true}} : ({t}, !stablehlo.token) -> !stablehlo.token",
                        x.name
                    ),
                );
                Ok(x)
            }
            _ => {
                self.emit(
                    out,
                    ind,
                    &format!(
                        "{name}:2 = \"stablehlo.recv\"({tok}) {{channel_handle = #stablehlo.channel_handle<handle = 2, type = 3>, is_host_transfer = true}} : (!stablehlo.token) -> ({t}, !stablehlo.token)"
                    ),
                );
                Ok(Val {
                    name: format!("{name}#0"),
                    ty: x.ty,
                })
            }
        }
    }

    fn custom_call(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        self.facts.custom_call = true;
        let x = self.any_value(scope, out, ind)?;
        let target = *self.u.choose(&[
            "tpubox.fuzz.unknown",
            "",
            "Sharding",
            "annotate_device_placement",
            "lapack_sgetrf_ffi",
            "__cpu$xla.cpu.topk",
            "xla_python_cpu_callback",
            "MoveToHost",
        ])?;
        let side = self.u.ratio(1, 2)?;
        let ty = x.ty.clone();
        Ok(self.simple(
            out,
            ind,
            "custom_call",
            &[&x],
            &format!("call_target_name = \"{target}\", has_side_effect = {side}"),
            ty,
        ))
    }

    fn chain(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let mut x = self.any_value(scope, out, ind)?;
        let room = self.opts.max_ops.saturating_sub(self.facts.ops);
        let n = self.u.int_in_range(1..=room.clamp(1, 2000))?;
        let op = self.binary_op(x.ty.et)?;
        for _ in 0..n {
            let ty = x.ty.clone();
            let y = x.clone();
            x = self.simple(out, ind, op, &[&y, &y], "", ty);
        }
        Ok(x)
    }

    fn iota(&mut self, out: &mut String, ind: usize) -> Result<Val> {
        let mut ty = self.small_ty()?;
        if ty.rank() == 0 {
            ty.dims.push(self.new_dim()?);
        }
        if ty.et == P::Pred {
            ty.et = P::S32;
        }
        let d = self.u.choose_index(ty.rank())?;
        let name = self.fresh();
        self.note_size(&ty);
        self.emit(
            out,
            ind,
            &format!(
                "{name} = \"stablehlo.iota\"() {{iota_dimension = {d} : i64}} : () -> {}",
                ty.mlir()
            ),
        );
        Ok(Val { name, ty })
    }

    fn clamp_bitcast(&mut self, scope: &[Val], out: &mut String, ind: usize) -> Result<Val> {
        let x = self.any_value(scope, out, ind)?;
        let same_width = match x.ty.et {
            P::F32 => Some(*self.u.choose(&[P::S32, P::U32])?),
            P::S32 => Some(P::F32),
            P::U32 => Some(P::F32),
            P::F64 => Some(P::S64),
            P::S64 => Some(P::F64),
            P::F16 => Some(P::Bf16),
            P::Bf16 => Some(P::F16),
            P::S8 => Some(P::U8),
            P::U8 => Some(P::S8),
            _ => None,
        };
        if let Some(et) = same_width.filter(|_| self.u.ratio(1, 2).unwrap_or(false)) {
            let ty = x.ty.with_et(et);
            return Ok(self.simple(out, ind, "bitcast_convert", &[&x], "", ty));
        }
        if x.ty.et == P::Pred {
            return Ok(x);
        }
        let a = self.literal(x.ty.et)?;
        let b = self.literal(x.ty.et)?;
        let lo = self.scalar_const(x.ty.et, &a, out, ind);
        let hi = self.scalar_const(x.ty.et, &b, out, ind);
        let ty = x.ty.clone();
        Ok(self.simple(out, ind, "clamp", &[&lo, &x, &hi], "", ty))
    }

    fn rng(&mut self, out: &mut String, ind: usize) -> Result<Val> {
        let state = self.fresh();
        self.emit(
            out,
            ind,
            &format!(
                "{state} = \"stablehlo.constant\"() {{value = dense<[7, 11]> : tensor<2xui64>}} : () -> tensor<2xui64>"
            ),
        );
        let mut ty = self.small_ty()?;
        ty.et = *self.u.choose(&[P::U32, P::U64, P::U8])?;
        let name = self.fresh();
        let algo = *self.u.choose(&["DEFAULT", "THREE_FRY", "PHILOX"])?;
        self.emit(
            out,
            ind,
            &format!(
                "{name}:2 = \"stablehlo.rng_bit_generator\"({state}) {{rng_algorithm = #stablehlo<rng_algorithm {algo}>}} : (tensor<2xui64>) -> (tensor<2xui64>, {})",
                ty.mlir()
            ),
        );
        Ok(Val {
            name: format!("{name}#1"),
            ty,
        })
    }
}
