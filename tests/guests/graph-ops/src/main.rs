//! A test guest for `tpubox_guest::graph`: for every op and helper it builds a tiny graph, runs
//! it on fixed inputs and prints one line `NAME: [values]` (a JSON array of the row-major
//! result: numbers for floats, integers for integer and `pred` results). A case that fails
//! prints `NAME: ERROR <error>` instead, and the guest goes on.
//!
//! The inputs come from [`data`] and [`pos`], restated in `tests/all/graph.rs`, which computes the
//! expected values independently.

use tpubox_guest::graph::{Compare, Graph, Precision, Value};
use tpubox_guest::{Dtype, Element, Result, Tensor};

#[path = "../../test_data.rs"]
mod test_data;
use test_data::{data, pos};

fn json<T: Copy>(xs: &[T], f: impl Fn(T) -> String) -> String {
    let items: Vec<String> = xs.iter().map(|&x| f(x)).collect();
    format!("[{}]", items.join(", "))
}

/// Prints an output tensor as a JSON array.
fn print_tensor(name: &str, t: &Tensor) -> Result<()> {
    let line = match t.dtype() {
        Dtype::F32 => json(&t.to_vec::<f32>()?, |x| format!("{x:?}")),
        Dtype::S32 => json(&t.to_vec::<i32>()?, |x| x.to_string()),
        Dtype::S64 => json(&t.to_vec::<i64>()?, |x| x.to_string()),
        Dtype::Pred => json(&t.to_vec::<bool>()?, |x| u8::from(x).to_string()),
        d => {
            return Err(tpubox_guest::Error::invalid_argument(format!(
                "no printer for {d}"
            )));
        }
    };
    println!("{name}: {line}");
    Ok(())
}

/// A graph under construction with its argument tensors.
struct Case {
    g: Graph,
    args: Vec<Tensor>,
}

impl Case {
    fn new() -> Self {
        Case {
            g: Graph::new(),
            args: Vec::new(),
        }
    }

    /// A parameter fed with `data`.
    fn input<T: Element>(&mut self, data: &[T], dims: &[u64]) -> Result<Value> {
        self.args.push(Tensor::from_slice(data, dims)?);
        Ok(self.g.parameter(T::DTYPE, dims))
    }

    /// Compiles with `outputs`, runs, and prints each output as `names[i]`.
    fn run(&self, names: &[&str], outputs: &[Value]) -> Result<()> {
        let exe = self.g.compile(outputs)?;
        let args: Vec<&Tensor> = self.args.iter().collect();
        let outs = exe.call(&args)?;
        for ((name, &v), t) in names.iter().zip(outputs).zip(&outs) {
            // The graph's shape inference must agree with the compiler's.
            if *t.spec() != self.g.spec(v) {
                return Err(tpubox_guest::Error::invalid_argument(format!(
                    "{name}: host returned {} for graph spec {}",
                    t.spec(),
                    self.g.spec(v)
                )));
            }
            print_tensor(name, t)?;
        }
        Ok(())
    }
}

/// Runs one case; on failure prints `NAME: ERROR ...` for its first name.
fn case(names: &[&str], build: impl FnOnce(&mut Case) -> Result<Vec<Value>>) {
    let mut c = Case::new();
    let r = build(&mut c).and_then(|outs| c.run(names, &outs));
    if let Err(e) = r {
        println!("{}: ERROR {e}", names[0]);
    }
}

type Binary = fn(&Graph, Value, Value) -> Result<Value>;
type Unary = fn(&Graph, Value) -> Result<Value>;

fn main() {
    // Element-wise binary ops, with broadcasting.
    case(&["add"], |c| {
        let a = c.input(&data(6, 1), &[2, 3])?;
        let b = c.input(&data(3, 2), &[3])?;
        Ok(vec![c.g.add(a, b)?])
    });
    case(&["sub"], |c| {
        let a = c.input(&data(2, 3), &[2, 1])?;
        let b = c.input(&data(3, 4), &[1, 3])?;
        Ok(vec![c.g.sub(a, b)?])
    });
    case(&["mul"], |c| {
        let a = c.input(&data(6, 5), &[2, 3])?;
        let s = c.g.scalar(1.5f32);
        Ok(vec![c.g.mul(a, s)?])
    });
    case(&["div"], |c| {
        let a = c.input(&data(6, 6), &[2, 3])?;
        let b = c.input(&pos(6, 7), &[2, 3])?;
        Ok(vec![c.g.div(a, b)?])
    });
    let binaries: [(&str, Binary); 3] = [
        ("maximum", Graph::maximum),
        ("minimum", Graph::minimum),
        ("pow", Graph::pow),
    ];
    for (name, f) in binaries {
        case(&[name], |c| {
            let a = c.input(&pos(4, 8), &[4])?;
            let b = c.input(&data(4, 9), &[4])?;
            Ok(vec![f(&c.g, a, b)?])
        });
    }

    // Element-wise unary ops.
    let unaries: [(&str, Unary, bool); 9] = [
        ("neg", Graph::neg, false),
        ("exp", Graph::exp, false),
        ("tanh", Graph::tanh, false),
        ("abs", Graph::abs, false),
        ("logistic", Graph::logistic, false),
        ("erf", Graph::erf, false),
        ("log", Graph::log, true),
        ("sqrt", Graph::sqrt, true),
        ("rsqrt", Graph::rsqrt, true),
    ];
    for (name, f, positive) in unaries {
        case(&[name], |c| {
            let x = if positive { pos(6, 13) } else { data(6, 12) };
            let a = c.input(&x, &[2, 3])?;
            Ok(vec![f(&c.g, a)?])
        });
    }
    // erf over a wider range, where a loose approximation would show.
    case(&["erf_wide"], |c| {
        let x: Vec<f32> = data(23, 40).iter().map(|x| x * 2.0).collect();
        let a = c.input(&x, &[23])?;
        Ok(vec![c.g.erf(a)?])
    });

    // Contractions.
    case(&["dot_general"], |c| {
        let a = c.input(&data(24, 14), &[2, 3, 4])?;
        let b = c.input(&data(40, 15), &[2, 5, 4])?;
        Ok(vec![c.g.dot_general(
            a,
            b,
            ((&[2], &[2]), (&[0], &[0])),
            Precision::Highest,
        )?])
    });
    case(&["matmul"], |c| {
        let a = c.input(&data(24, 16), &[2, 3, 4])?;
        let w = c.input(&data(20, 17), &[4, 5])?;
        Ok(vec![c.g.matmul(a, w, Precision::Default)?])
    });
    case(&["matmul_batched"], |c| {
        let a = c.input(&data(24, 16), &[2, 3, 4])?;
        let b = c.input(&data(16, 18), &[2, 4, 2])?;
        Ok(vec![c.g.matmul(a, b, Precision::High)?])
    });

    // Shape ops.
    case(&["broadcast_in_dim"], |c| {
        let a = c.input(&data(3, 19), &[3])?;
        Ok(vec![c.g.broadcast_in_dim(a, &[2, 3, 4], &[1])?])
    });
    case(&["broadcast_to"], |c| {
        let a = c.input(&data(3, 20), &[3, 1])?;
        Ok(vec![c.g.broadcast_to(a, &[2, 3, 4])?])
    });
    case(&["reshape", "transpose"], |c| {
        let a = c.input(&data(24, 21), &[2, 3, 4])?;
        let r = c.g.reshape(a, &[4, 6])?;
        let t = c.g.transpose(a, &[2, 0, 1])?;
        Ok(vec![r, t])
    });
    case(&["reduce_sum", "reduce_max"], |c| {
        let a = c.input(&data(24, 22), &[2, 3, 4])?;
        let s = c.g.reduce_sum(a, &[2, 0])?;
        let m = c.g.reduce_max(a, &[1])?;
        Ok(vec![s, m])
    });
    case(&["reduce_sum_s32", "reduce_max_s32"], |c| {
        let a = c.input(&[3i32, -7, 12, 0, -1, -20], &[2, 3])?;
        let s = c.g.reduce_sum(a, &[1])?;
        let m = c.g.reduce_max(a, &[0])?;
        Ok(vec![s, m])
    });
    case(&["convert_f32_s32", "convert_s32_f32"], |c| {
        let x: Vec<f32> = data(6, 23).iter().map(|x| x * 2.5).collect();
        let a = c.input(&x, &[6])?;
        let i = c.input(&[-3i32, 7, 0, 123_456], &[4])?;
        let to_i = c.g.convert(a, Dtype::S32)?;
        let to_f = c.g.convert(i, Dtype::F32)?;
        Ok(vec![to_i, to_f])
    });

    // Compare and select.
    let dirs = [
        ("compare_eq", Compare::Eq),
        ("compare_ne", Compare::Ne),
        ("compare_lt", Compare::Lt),
        ("compare_le", Compare::Le),
        ("compare_gt", Compare::Gt),
        ("compare_ge", Compare::Ge),
    ];
    let names: Vec<&str> = dirs.iter().map(|d| d.0).collect();
    case(&names, |c| {
        let a = c.input(&data(6, 24), &[2, 3])?;
        // b is the first row of a, so row 0 compares equal.
        let b = c.input(&data(3, 24), &[3])?;
        dirs.iter().map(|&(_, d)| c.g.compare(a, b, d)).collect()
    });
    case(&["select"], |c| {
        let a = c.input(&data(6, 25), &[2, 3])?;
        let zero = c.g.scalar(0.0f32);
        let minus_one = c.g.scalar(-1.0f32);
        let p = c.g.compare(a, zero, Compare::Gt)?;
        Ok(vec![c.g.select(p, a, minus_one)?])
    });
    case(&["iota_s32", "iota_f32"], |c| {
        let a = c.g.iota(Dtype::S32, &[2, 3], 1)?;
        let b = c.g.iota(Dtype::F32, &[3, 2], 0)?;
        Ok(vec![a, b])
    });

    // Gather, slice, concatenate.
    case(&["take"], |c| {
        let table = c.input(&data(15, 26), &[5, 3])?;
        let idx = c.input(&[4i32, 0, 2, 2], &[2, 2])?;
        Ok(vec![c.g.take(table, idx)?])
    });
    case(&["slice"], |c| {
        let a = c.input(&data(24, 27), &[4, 6])?;
        Ok(vec![c.g.slice(a, &[1, 0], &[4, 6], &[2, 4])?])
    });
    case(&["concatenate"], |c| {
        let a = c.input(&data(6, 28), &[2, 3])?;
        let b = c.input(&data(2, 29), &[2, 1])?;
        Ok(vec![c.g.concatenate(&[a, b, a], 1)?])
    });

    // Constants.
    case(&["constant", "constant_big", "constant_s64"], |c| {
        let k =
            c.g.constant(&[1.0f32, -2.5, 3.25, 0.0, 1e-3, -7.0], &[2, 3])?;
        let half = c.g.scalar(0.5f32);
        let k = c.g.add(k, half)?;
        let big = c.g.constant(&data(100, 35), &[10, 10])?;
        let s64 = c.g.constant(&[-5i64, 1 << 40, 3], &[3])?;
        let one = c.g.scalar(1i64);
        let s64 = c.g.add(s64, one)?;
        Ok(vec![k, big, s64])
    });

    // Helpers.
    case(&["softmax", "softmax_axis0"], |c| {
        let x: Vec<f32> = data(8, 30).iter().map(|x| x * 3.0).collect();
        let a = c.input(&x, &[2, 4])?;
        let s1 = c.g.softmax(a, 1)?;
        let s0 = c.g.softmax(a, 0)?;
        Ok(vec![s1, s0])
    });
    case(&["layer_norm"], |c| {
        let x = c.input(&data(10, 31), &[2, 5])?;
        let gamma = c.input(&pos(5, 32), &[5])?;
        let beta = c.input(&data(5, 33), &[5])?;
        Ok(vec![c.g.layer_norm(x, gamma, beta, 1e-5)?])
    });
    case(&["gelu"], |c| {
        let x: Vec<f32> = data(8, 34).iter().map(|x| x * 2.0).collect();
        let a = c.input(&x, &[8])?;
        Ok(vec![c.g.gelu(a)?])
    });
}
