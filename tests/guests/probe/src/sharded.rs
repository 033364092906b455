//! `sharded NAME`: programs over several devices and sharded arrays (WIT 0.1.2 `sharding`),
//! one line per fact, asserted by `tests/all/spmd.rs`. The host runs the guest on a CPU
//! plugin with four devices.
//!
//! - `run`: the two programs of `tests/programs` over devices 0-3: `spmd_gspmd4` (a sum split
//!   by rows plus a full reduction; GSPMD shardings) and `spmd_psum4` (a `shard_map` `psum`,
//!   an all-reduce; Shardy shardings): prints their layouts, per-shard devices and the gathered
//!   values; then a donated argument and one shard read on its own.
//! - `hostile`: each bad call through the raw bindings, printing the error kind the host
//!   returned: shards that lie about their sizes or devices, puts whose bytes lie, shardings
//!   that do not parse or nest too deep, devices given twice or unknown, a program whose
//!   partition count is not its devices'.
//! - `outside`: compiles the four-device program while placed on fewer devices.

use tpubox_guest::bindings::tpubox::device::{client, sharding, types};
use tpubox_guest::sharded::{ShardedArray, ShardedExecutable};
use tpubox_guest::{Dtype, Tensor, TensorSpec};

const GSPMD: &str = include_str!("../../../programs/spmd_gspmd4.mlir");
const PSUM: &str = include_str!("../../../programs/spmd_psum4.mlir");
const ALL: [u32; 4] = [0, 1, 2, 3];
const ROWS: &str = "{devices=[4,1]<=[4]}";

fn report<T>(name: &str, r: Result<T, types::Error>) {
    match r {
        Ok(_) => println!("{name}: ok"),
        Err(e) => println!("{name}: {} ({})", e.kind.name(), e.message),
    }
}

fn iota(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    tpubox_guest::encode(v)
}

pub fn run(name: &str) {
    match name {
        "run" => run_programs(),
        "hostile" => hostile(),
        "outside" => report(
            "compile-outside",
            sharding::compile(client::ProgramFormat::MlirText, GSPMD.as_bytes(), &ALL),
        ),
        other => {
            eprintln!("probe: no sharded case {other:?}");
            std::process::exit(2);
        }
    }
}

fn run_programs() {
    let gspmd = ShardedExecutable::compile_mlir(GSPMD, &ALL).expect("the GSPMD program compiles");
    let l = gspmd.layout();
    println!("gspmd-devices: {:?}", l.devices);
    let shardings = |s: &[sharding::ShardedSpec]| {
        s.iter()
            .map(|p| format!("{}{:?} {}", p.global.dtype, p.global.dims, p.sharding))
            .collect::<Vec<_>>()
            .join("; ")
    };
    println!("gspmd-parameters: {}", shardings(&l.parameters));
    println!("gspmd-results: {}", shardings(&l.results));
    println!(
        "gspmd-shard-inputs: {:?}",
        gspmd.executable().inputs()[0].dims
    );
    let a = gspmd.put(0, &iota(24)).expect("a goes on");
    let b = gspmd.put(1, &[1.0f32; 24]).expect("b goes on");
    println!(
        "a-shards: {:?}",
        a.shards()
            .iter()
            .map(|t| (t.device(), t.dims().to_vec()))
            .collect::<Vec<_>>()
    );
    let out = gspmd.call(&[&a, &b]).expect("the GSPMD program runs");
    println!("gspmd-sum: {:?}", out[0].to_vec::<f32>().unwrap());
    println!("gspmd-total: {:?}", out[1].to_vec::<f32>().unwrap());
    println!(
        "gspmd-out-devices: {:?}",
        out[0]
            .shards()
            .iter()
            .map(Tensor::device)
            .collect::<Vec<_>>()
    );
    // One shard on its own: rows 6..8 of a+b, on device 3.
    println!("shard-3: {:?}", out[0].shards()[3].to_vec::<f32>().unwrap());

    let psum = ShardedExecutable::compile_mlir(PSUM, &ALL).expect("the psum program compiles");
    let x = psum.put(0, &iota(24)).expect("x goes on");
    let y = psum
        .call_donating(&[&x], &[0])
        .expect("the psum program runs");
    println!("psum: {:?}", y[0].to_vec::<f32>().unwrap());
    println!("psum-result-sharding: {}", y[0].sharding());
    report(
        "read-donated",
        sharding::read(
            x.spec(),
            x.sharding(),
            x.devices(),
            &x.shards().iter().map(Tensor::as_raw).collect::<Vec<_>>(),
        ),
    );
    // The same array put by hand with the sharding's text, read back whole.
    let z = ShardedArray::from_slice(&iota(6), &[2, 3], "{devices=[2,1]<=[2]}", &[2, 0])
        .expect("a two-device array goes on");
    println!(
        "by-hand: {:?} on {:?}",
        z.to_vec::<f32>().unwrap(),
        z.shards().iter().map(Tensor::device).collect::<Vec<_>>()
    );
}

fn hostile() {
    let fmt = client::ProgramFormat::MlirText;
    let exe = sharding::compile(fmt, GSPMD.as_bytes(), &ALL).expect("compiles");
    let spec = TensorSpec {
        dtype: Dtype::F32,
        dims: vec![8, 3],
    };
    let good = || sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(24)), ROWS, &ALL).unwrap();
    let replicated = || {
        sharding::put(
            Dtype::F32,
            &[8, 3],
            &bytes(&[1.0; 24]),
            "{replicated}",
            &ALL,
        )
        .unwrap()
    };

    report(
        "put-short-bytes",
        sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(23)), ROWS, &ALL),
    );
    report(
        "put-bad-sharding",
        sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(24)), "{devices=[", &ALL),
    );
    report(
        "put-nested-sharding",
        sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(24)), "{{{{}}}}", &ALL),
    );
    report(
        "put-device-twice",
        sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(24)), ROWS, &[0, 1, 1, 2]),
    );
    report(
        "put-too-few-devices",
        sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(24)), ROWS, &[0, 1]),
    );
    report(
        "put-unknown-device",
        sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(24)), ROWS, &[0, 1, 2, 9]),
    );
    report(
        "put-no-devices",
        sharding::put(Dtype::F32, &[8, 3], &bytes(&iota(24)), "{replicated}", &[]),
    );

    // Shards that lie about their sizes: a whole array where a quarter belongs.
    let whole: Vec<types::Tensor> = ALL
        .iter()
        .map(|&d| {
            types::Tensor::from_bytes(Dtype::F32, &[8, 3], &bytes(&iota(24)), Some(d)).unwrap()
        })
        .collect();
    let refs: Vec<&types::Tensor> = whole.iter().collect();
    report("read-lying-sizes", sharding::read(&spec, ROWS, &ALL, &refs));
    let b = replicated();
    let brefs: Vec<&types::Tensor> = b.iter().collect();
    report(
        "execute-lying-sizes",
        sharding::execute(&exe, &[refs.clone(), brefs.clone()], &[]),
    );
    // Shards that lie about their devices: the right sizes, in the wrong order.
    let a = good();
    let mut swapped: Vec<&types::Tensor> = a.iter().collect();
    swapped.swap(0, 1);
    report(
        "read-lying-devices",
        sharding::read(&spec, ROWS, &ALL, &swapped),
    );
    report(
        "execute-lying-devices",
        sharding::execute(&exe, &[swapped.clone(), brefs.clone()], &[]),
    );
    report(
        "execute-short-shards",
        sharding::execute(&exe, &[swapped[..3].to_vec(), brefs.clone()], &[]),
    );
    report(
        "execute-arg-count",
        sharding::execute(&exe, std::slice::from_ref(&brefs), &[]),
    );
    report(
        "execute-donate-range",
        sharding::execute(&exe, &[brefs.clone(), brefs.clone()], &[7]),
    );
    let single = client::compile(
        fmt,
        b"func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> { return %a : tensor<2xf32> }",
        client::CompileOptions { device: None },
    )
    .unwrap();
    report(
        "execute-one-device-program",
        sharding::execute(&single, std::slice::from_ref(&brefs), &[]),
    );
    report(
        "compile-partitions-differ",
        sharding::compile(fmt, GSPMD.as_bytes(), &[0, 1]),
    );
    report(
        "compile-device-twice",
        sharding::compile(fmt, GSPMD.as_bytes(), &[0, 1, 2, 2]),
    );
    report(
        "compile-unknown-device",
        sharding::compile(fmt, GSPMD.as_bytes(), &[0, 1, 2, 9]),
    );
    report(
        "compile-no-devices",
        sharding::compile(fmt, GSPMD.as_bytes(), &[]),
    );
    // The good arrays still work after all that.
    let ok = sharding::execute(&exe, &[a.iter().collect(), brefs], &[]).expect("runs");
    let sum = sharding::read(&spec, ROWS, &ALL, &ok[0].iter().collect::<Vec<_>>()).unwrap();
    println!(
        "after: {:?}",
        tpubox_guest::decode::<f32>(&sum).unwrap()[..6].to_vec()
    );
}
