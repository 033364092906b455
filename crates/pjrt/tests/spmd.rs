//! Programs over several devices on 4 CPU devices (`cpu_device_count` 4): SPMD partitions
//! (GSPMD `mhlo.sharding` and Shardy `sdy.sharding` modules, hand-written and exported by JAX),
//! replicas, their collectives, and the checks `execute_sharded` makes before PJRT.
//!
//! The JAX corpus is made at test time by the pinned JAX of the set-up script's venv
//! (`tests/spmd/make_spmd.py`, `~/.cache/tpubox/venv-jax`) into a temporary directory: each
//! case's module, its global inputs and JAX's own outputs on 4 CPU devices, and the shardings
//! XLA chose when JAX compiled it. Each case is compiled here for the 4 devices, its inputs
//! split by the executable's parameter shardings, run on all 4 at once, and its outputs
//! gathered by the output shardings and compared with JAX's.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use pjrt::{
    Buffer, Client, CompileOptions, DeviceAssignment, ErrorCode, Execution, HloSharding,
    LoadedExecutable, NamedValue, PrimitiveType, Program,
};

fn client4() -> Client {
    Client::new(&plugin(), &[("cpu_device_count", NamedValue::Int64(4))]).expect("client")
}

fn ids(c: &Client) -> Vec<i64> {
    c.devices()
        .unwrap()
        .iter()
        .map(|d| i64::from(d.id()))
        .collect()
}

/// A global f32 array.
#[derive(Debug, Clone, PartialEq)]
struct Array {
    dims: Vec<i64>,
    data: Vec<f32>,
}

impl Array {
    fn new(dims: &[i64], data: Vec<f32>) -> Self {
        assert_eq!(data.len() as i64, dims.iter().product::<i64>());
        Self {
            dims: dims.to_vec(),
            data,
        }
    }

    fn iota(dims: &[i64]) -> Self {
        let n: i64 = dims.iter().product();
        Self::new(dims, (0..n).map(|x| x as f32).collect())
    }
}

/// Splits each global argument by the executable's parameter shardings into one buffer per
/// device (in the executable's device order) and uploads them.
fn split(c: &Client, exe: &LoadedExecutable, args: &[Array]) -> Vec<Vec<Buffer>> {
    let devices = exe.addressable_devices().unwrap();
    let shardings = exe.parameter_shardings().unwrap();
    let specs = exe.parameter_specs().unwrap();
    assert_eq!(args.len(), shardings.len());
    let mut out: Vec<Vec<Buffer>> = devices.iter().map(|_| Vec::new()).collect();
    for ((a, s), spec) in args.iter().zip(&shardings).zip(&specs) {
        // The program's per-device parameter is the sharding's tile of the global array.
        assert_eq!(
            s.tile_dims(&a.dims).unwrap(),
            spec.dims,
            "{s} of {:?}",
            a.dims
        );
        let bytes = f32_bytes(&a.data);
        for (k, shard) in s.shards(&a.dims, devices.len()).unwrap().iter().enumerate() {
            let part = shard.extract(&bytes, &a.dims, 4, &spec.dims).unwrap();
            let b = c
                .buffer_from_host(&part, PrimitiveType::F32, &spec.dims, &devices[k])
                .unwrap();
            out[k].push(b);
        }
    }
    out
}

/// Waits for every device, then gathers each output by the executable's output shardings
/// into a global array of `dims[j]`; checks that every copy of a replicated shard is equal.
fn gather(exe: &LoadedExecutable, runs: Vec<Execution>, dims: &[Vec<i64>]) -> Vec<Array> {
    let shardings = exe.output_shardings().unwrap();
    let specs = exe.output_specs().unwrap();
    assert_eq!(specs, exe.local_output_specs().unwrap());
    assert_eq!(shardings.len(), dims.len());
    let n = runs.len();
    let mut host: Vec<Vec<Vec<u8>>> = Vec::new();
    for run in runs {
        run.done.wait_blocking().unwrap();
        host.push(
            run.outputs
                .iter()
                .map(|b| b.to_host_blocking().unwrap())
                .collect(),
        );
    }
    let mut out = Vec::new();
    for (j, (s, global)) in shardings.iter().zip(dims).enumerate() {
        assert_eq!(
            s.tile_dims(global).unwrap(),
            specs[j].dims,
            "output {j}: {s}"
        );
        let len = global.iter().product::<i64>() as usize * 4;
        let mut bytes = vec![0u8; len];
        let shards = s.shards(global, n).unwrap();
        for (k, shard) in shards.iter().enumerate().filter(|(_, s)| s.primary) {
            shard
                .insert(&host[k][j], &specs[j].dims, &mut bytes, global, 4)
                .unwrap();
        }
        // Every copy of a shard (replicated, or along a replicated subgroup) is the same.
        for (k, shard) in shards.iter().enumerate() {
            if shard.dims() == specs[j].dims {
                let copy = shard.extract(&bytes, global, 4, &specs[j].dims).unwrap();
                assert_eq!(host[k][j], copy, "output {j} on device {k}");
            }
        }
        out.push(Array::new(global, bytes_f32(&bytes)));
    }
    out
}

fn close(got: &[f32], want: &[f32], rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rtol * (1.0 + w.abs());
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i} is {g}, JAX gives {w} (rtol {rtol})"
        );
    }
}

// A GSPMD module (`mhlo.sharding`): `a` split by rows, `b` replicated; the sum over the split
// rows needs an all-reduce, which the partitioner inserts.
const GSPMD: &str = r#"
module @sharded attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<8x3xf32> {mhlo.sharding = "{devices=[4,1]<=[4]}"}, %b: tensor<8x3xf32> {mhlo.sharding = "{replicated}"}) -> (tensor<8x3xf32> {mhlo.sharding = "{devices=[4,1]<=[4]}"}, tensor<f32> {mhlo.sharding = "{replicated}"}) {
    %0 = stablehlo.add %a, %b : tensor<8x3xf32>
    %cst = stablehlo.constant dense<0.0> : tensor<f32>
    %1 = stablehlo.reduce(%a init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x3xf32>, tensor<f32>) -> tensor<f32>
    return %0, %1 : tensor<8x3xf32>, tensor<f32>
  }
}
"#;

// The same program as `jax.export` writes it with Shardy (`sdy.mesh`, `sdy.sharding`), on a
// 2x2 mesh: `a` split by rows along "i" and by columns along "j".
const SHARDY: &str = r#"
module @sharded attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["i"=2, "j"=2]>
  func.func public @main(%a: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"i"}, {"j"}]>}, %b: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"j"}, {"i"}]>}, tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>}) {
    %0 = stablehlo.add %a, %b : tensor<8x4xf32>
    %cst = stablehlo.constant dense<0.0> : tensor<f32>
    %1 = stablehlo.reduce(%a init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
    return %0, %1 : tensor<8x4xf32>, tensor<f32>
  }
}
"#;

// `shard_map` with a psum as Shardy writes it: a manual computation over the mesh axis.
const SHARDY_PSUM: &str = r#"
module @psum attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["x"=4]>
  func.func public @main(%arg0: tensor<8x3xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) -> (tensor<2x3xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"x"}, {}]>] out_shardings=[<@mesh, [{}, {}]>] manual_axes={"x"} (%arg1: tensor<2x3xf32>) {
      %1 = "stablehlo.all_reduce"(%arg1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>, use_global_device_ids}> ({
      ^bb0(%x: tensor<f32>, %y: tensor<f32>):
        %s = stablehlo.add %x, %y : tensor<f32>
        stablehlo.return %s : tensor<f32>
      }) : (tensor<2x3xf32>) -> tensor<2x3xf32>
      sdy.return %1 : tensor<2x3xf32>
    } : (tensor<8x3xf32>) -> tensor<2x3xf32>
    return %0 : tensor<2x3xf32>
  }
}
"#;

// Four replicas of a program whose all-reduce sums over the replicas.
const REPLICAS: &str = r#"
module @replicas attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 4 : i32} {
  func.func public @main(%a: tensor<3xf32>) -> tensor<3xf32> {
    %0 = "stablehlo.all_reduce"(%a) ({
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %s = stablehlo.add %x, %y : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>} : (tensor<3xf32>) -> tensor<3xf32>
    return %0 : tensor<3xf32>
  }
}
"#;

// A partitioned program whose sharded parameter may be donated to its output.
const DONATE: &str = r#"
module @donate attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<8xf32> {mhlo.sharding = "{devices=[4]<=[4]}", tf.aliasing_output = 0 : i32}) -> (tensor<8xf32> {mhlo.sharding = "{devices=[4]<=[4]}"}) {
    %0 = stablehlo.multiply %a, %a : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
"#;

fn strings(v: &[HloSharding]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn gspmd_module_runs_on_four_devices() {
    let c = client4();
    let exe = c
        .compile(
            &Program::mlir(GSPMD),
            &CompileOptions::spmd(&ids(&c)).unwrap(),
        )
        .unwrap();
    assert_eq!(exe.num_partitions().unwrap(), 4);
    assert_eq!(exe.num_replicas().unwrap(), 1);
    let devices: Vec<i64> = exe
        .addressable_devices()
        .unwrap()
        .iter()
        .map(|d| i64::from(d.id()))
        .collect();
    assert_eq!(devices, ids(&c));
    assert_eq!(
        strings(&exe.parameter_shardings().unwrap()),
        ["{devices=[4,1]<=[4]}", "{replicated}"]
    );
    assert_eq!(
        strings(&exe.output_shardings().unwrap()),
        ["{devices=[4,1]<=[4]}", "{replicated}"]
    );
    let dims: Vec<Vec<i64>> = exe
        .parameter_specs()
        .unwrap()
        .into_iter()
        .map(|s| s.dims)
        .collect();
    assert_eq!(dims, [vec![2, 3], vec![8, 3]]);
    let a = Array::iota(&[8, 3]);
    let b = Array::new(&[8, 3], vec![0.5; 24]);
    let bufs = split(&c, &exe, &[a.clone(), b]);
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|l| l.iter().collect()).collect();
    let runs = exe.execute_sharded(&args, &[]).unwrap();
    assert_eq!(runs.len(), 4);
    let out = gather(&exe, runs, &[vec![8, 3], vec![]]);
    let want: Vec<f32> = a.data.iter().map(|x| x + 0.5).collect();
    assert_eq!(out[0].data, want);
    assert_eq!(out[1].data, [a.data.iter().sum::<f32>()]);
}

#[test]
fn shardy_module_on_a_2x2_mesh() {
    let c = client4();
    // Without Shardy, XLA would read no shardings from `sdy.sharding` attributes.
    let exe = c
        .compile(
            &Program::mlir(SHARDY),
            &CompileOptions::spmd(&ids(&c)).unwrap(),
        )
        .unwrap();
    assert_eq!(
        strings(&exe.parameter_shardings().unwrap()),
        ["{devices=[2,2]<=[4]}", "{replicated}"]
    );
    // The output split by rows along "j" (the mesh's minor axis) and by columns along "i".
    assert_eq!(
        strings(&exe.output_shardings().unwrap()),
        ["{devices=[2,2]<=[2,2]T(1,0)}", "{replicated}"]
    );
    let a = Array::iota(&[8, 4]);
    let b = Array::new(&[8, 4], (0..32).map(|x| (x * x) as f32).collect());
    let bufs = split(&c, &exe, &[a.clone(), b.clone()]);
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|l| l.iter().collect()).collect();
    let out = gather(
        &exe,
        exe.execute_sharded(&args, &[]).unwrap(),
        &[vec![8, 4], vec![]],
    );
    let want: Vec<f32> = a.data.iter().zip(&b.data).map(|(x, y)| x + y).collect();
    assert_eq!(out[0].data, want);
    assert_eq!(out[1].data, [a.data.iter().sum::<f32>()]);
}

#[test]
fn shard_map_psum_needs_the_shardy_partitioner() {
    let c = client4();
    let gspmd = CompileOptions::spmd(&ids(&c))
        .unwrap()
        .use_shardy_partitioner(false);
    let e = c.compile(&Program::mlir(SHARDY_PSUM), &gspmd).unwrap_err();
    eprintln!("without Shardy: {e}");
    let exe = c
        .compile(
            &Program::mlir(SHARDY_PSUM),
            &CompileOptions::spmd(&ids(&c)).unwrap(),
        )
        .unwrap();
    let a = Array::iota(&[8, 3]);
    let bufs = split(&c, &exe, std::slice::from_ref(&a));
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|l| l.iter().collect()).collect();
    let out = gather(
        &exe,
        exe.execute_sharded(&args, &[]).unwrap(),
        &[vec![2, 3]],
    );
    // Each device holds 2 rows; the psum adds the four blocks.
    let want: Vec<f32> = (0..6)
        .map(|i| (0..4).map(|k| a.data[k * 6 + i]).sum())
        .collect();
    assert_eq!(out[0].data, want);
}

#[test]
fn replicas_all_reduce() {
    let c = client4();
    let ids = ids(&c);
    let opts =
        CompileOptions::new().device_assignment(Some(DeviceAssignment::replicas(ids).unwrap()));
    let exe = c.compile(&Program::mlir(REPLICAS), &opts).unwrap();
    assert_eq!(exe.num_replicas().unwrap(), 4);
    assert_eq!(exe.num_partitions().unwrap(), 1);
    assert_eq!(
        exe.parameter_shardings().unwrap(),
        [HloSharding::Replicated]
    );
    let devices = exe.addressable_devices().unwrap();
    let bufs: Vec<Buffer> = devices
        .iter()
        .enumerate()
        .map(|(k, d)| {
            let v = [k as f32, 10.0 * k as f32, 1.0];
            c.buffer_from_host(&f32_bytes(&v), PrimitiveType::F32, &[3], d)
                .unwrap()
        })
        .collect();
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|b| vec![b]).collect();
    for (k, run) in exe
        .execute_sharded(&args, &[])
        .unwrap()
        .into_iter()
        .enumerate()
    {
        run.done.wait_blocking().unwrap();
        assert_eq!(run.outputs[0].device().unwrap(), devices[k]);
        let got = bytes_f32(&run.outputs[0].to_host_blocking().unwrap());
        assert_eq!(got, [6.0, 60.0, 4.0], "replica {k}");
    }
}

// Two replicas of a program of two partitions; the all-reduce sums over the replicas.
const REPLICAS_OF_PARTITIONS: &str = r#"
module @rp attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 2 : i32} {
  func.func public @main(%a: tensor<4xf32> {mhlo.sharding = "{devices=[2]<=[2]}"}) -> (tensor<4xf32> {mhlo.sharding = "{devices=[2]<=[2]}"}) {
    %0 = "stablehlo.all_reduce"(%a) ({
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %s = stablehlo.add %x, %y : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"#;

#[test]
fn replicas_of_partitions_run_replica_major() {
    let c = client4();
    let ids = ids(&c);
    // Replica 0 on devices 3, 1 and replica 1 on devices 0, 2 (partition order within each).
    let assigned = vec![ids[3], ids[1], ids[0], ids[2]];
    let opts = CompileOptions::new()
        .device_assignment(Some(DeviceAssignment::new(2, 2, assigned.clone()).unwrap()))
        .use_spmd_partitioning(true)
        .use_shardy_partitioner(true);
    let exe = c
        .compile(&Program::mlir(REPLICAS_OF_PARTITIONS), &opts)
        .unwrap();
    assert_eq!(
        (exe.num_replicas().unwrap(), exe.num_partitions().unwrap()),
        (2, 2)
    );
    let devices = exe.addressable_devices().unwrap();
    let order: Vec<i64> = devices.iter().map(|d| i64::from(d.id())).collect();
    assert_eq!(order, assigned);
    let s = &exe.parameter_shardings().unwrap()[0];
    assert_eq!(s.to_string(), "{devices=[2]<=[2]}");
    // Replica r's global input is [r+1; 4] + iota; device k runs partition k % 2.
    let shards = s.shards(&[4], 2).unwrap();
    let bufs: Vec<Buffer> = devices
        .iter()
        .enumerate()
        .map(|(k, d)| {
            let r = (k / 2) as f32;
            let global: Vec<f32> = (0..4).map(|i| i as f32 + 10.0 * (r + 1.0)).collect();
            let part = shards[k % 2]
                .extract(&f32_bytes(&global), &[4], 4, &[2])
                .unwrap();
            c.buffer_from_host(&part, PrimitiveType::F32, &[2], d)
                .unwrap()
        })
        .collect();
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|b| vec![b]).collect();
    let runs = exe.execute_sharded(&args, &[]).unwrap();
    for (k, run) in runs.into_iter().enumerate() {
        run.done.wait_blocking().unwrap();
        let got = bytes_f32(&run.outputs[0].to_host_blocking().unwrap());
        // Sum over the replicas of the partition's two elements: 10 + 20 + 2·i.
        let p = (k % 2) as f32;
        assert_eq!(got, [30.0 + 4.0 * p, 32.0 + 4.0 * p], "device {k}");
    }
}

#[test]
fn devices_in_another_order() {
    // Partition p runs on the p-th id of the assignment: reversed, device 3 holds rows 0..2.
    let c = client4();
    let mut rev = ids(&c);
    rev.reverse();
    let exe = c
        .compile(&Program::mlir(GSPMD), &CompileOptions::spmd(&rev).unwrap())
        .unwrap();
    let order: Vec<i64> = exe
        .addressable_devices()
        .unwrap()
        .iter()
        .map(|d| i64::from(d.id()))
        .collect();
    assert_eq!(order, rev);
    let a = Array::iota(&[8, 3]);
    let b = Array::new(&[8, 3], vec![0.0; 24]);
    let bufs = split(&c, &exe, &[a.clone(), b]);
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|l| l.iter().collect()).collect();
    let runs = exe.execute_sharded(&args, &[]).unwrap();
    let first = bytes_f32(&runs[0].outputs[0].to_host_blocking().unwrap());
    assert_eq!(runs[0].outputs[0].device().unwrap().id() as i64, rev[0]);
    assert_eq!(first, a.data[..6]);
    let out = gather(&exe, runs, &[vec![8, 3], vec![]]);
    assert_eq!(out[0].data, a.data);
}

#[test]
fn donation_on_every_device() {
    let c = client4();
    let exe = c
        .compile(
            &Program::mlir(DONATE),
            &CompileOptions::spmd(&ids(&c)).unwrap(),
        )
        .unwrap();
    let a = Array::iota(&[8]);
    let bufs = split(&c, &exe, std::slice::from_ref(&a));
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|l| l.iter().collect()).collect();
    let out = gather(&exe, exe.execute_sharded(&args, &[0]).unwrap(), &[vec![8]]);
    let want: Vec<f32> = a.data.iter().map(|x| x * x).collect();
    assert_eq!(out[0].data, want);
    for l in &bufs {
        assert!(l[0].is_deleted().unwrap());
    }
    // Donated shards cannot run again: an error, on no device.
    let e = exe.execute_sharded(&args, &[]).unwrap_err();
    eprintln!("donated shards again: {e}");
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
}

#[test]
fn execute_sharded_checks_before_pjrt() {
    let c = client4();
    let exe = c
        .compile(
            &Program::mlir(GSPMD),
            &CompileOptions::spmd(&ids(&c)).unwrap(),
        )
        .unwrap();
    let a = Array::iota(&[8, 3]);
    let bufs = split(&c, &exe, &[a.clone(), a.clone()]);
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|l| l.iter().collect()).collect();
    let code = |args: &[Vec<&Buffer>], donate: &[usize]| {
        let e = exe.execute_sharded(args, donate).unwrap_err();
        eprintln!("{e}");
        e.code
    };
    // One list short, one argument short, an argument of the wrong shape.
    assert_eq!(code(&args[..3], &[]), ErrorCode::InvalidArgument);
    let mut short = args.clone();
    short[2].pop();
    assert_eq!(code(&short, &[]), ErrorCode::InvalidArgument);
    let mut wrong = args.clone();
    wrong[1].swap(0, 1);
    assert_eq!(code(&wrong, &[]), ErrorCode::InvalidArgument);
    // Device 0's shard passed as device 1's.
    let mut moved = args.clone();
    moved.swap(0, 1);
    assert_eq!(code(&moved, &[]), ErrorCode::InvalidArgument);
    // Donation out of range or listed twice.
    assert_eq!(code(&args, &[2]), ErrorCode::InvalidArgument);
    assert_eq!(code(&args, &[0, 0]), ErrorCode::InvalidArgument);
    // A buffer of another client.
    let other = client4();
    let foreign = other
        .buffer_from_host(
            &f32_bytes(&[0.0; 6]),
            PrimitiveType::F32,
            &[2, 3],
            &other.devices().unwrap()[0],
        )
        .unwrap();
    let mut alien = args.clone();
    alien[0][0] = &foreign;
    assert_eq!(code(&alien, &[]), ErrorCode::InvalidArgument);
    // The one-device call refuses a program over four.
    let e = exe.execute(&args[0], &[]).unwrap_err();
    assert_eq!(e.code, ErrorCode::Unimplemented);
    // Nothing was consumed: the arguments still run.
    let out = gather(
        &exe,
        exe.execute_sharded(&args, &[]).unwrap(),
        &[vec![8, 3], vec![]],
    );
    let want: Vec<f32> = a.data.iter().map(|x| 2.0 * x).collect();
    assert_eq!(out[0].data, want);
}

#[test]
fn compile_refuses_assignments_that_do_not_fit() {
    let c = client4();
    let ids = ids(&c);
    // A device id the client does not have.
    let e = c
        .compile(
            &Program::mlir(GSPMD),
            &CompileOptions::spmd(&[ids[0], ids[1], ids[2], 99]).unwrap(),
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
    // A module of 4 partitions on 2 devices: the plugin's verifier refuses it.
    let e = c
        .compile(
            &Program::mlir(GSPMD),
            &CompileOptions::spmd(&ids[..2]).unwrap(),
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
    // Partitions without SPMD partitioning.
    let e = c
        .compile(
            &Program::mlir(GSPMD),
            &CompileOptions::new().num_partitions(4),
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
}

// ---- the JAX corpus ----

/// The JAX venv's python (`bash scripts/dev.sh setup` installs it).
fn jax_python() -> PathBuf {
    let root = match std::env::var_os("TPUBOX_CACHE_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tpubox"),
    };
    let p = root.join("venv-jax/bin/python");
    assert!(
        p.is_file(),
        "{} not found: run `bash scripts/dev.sh setup`",
        p.display()
    );
    p
}

/// A temporary directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn make_corpus() -> TempDir {
    let dir = std::env::temp_dir().join(format!("tpubox-spmd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/spmd/make_spmd.py");
    let out = std::process::Command::new(jax_python())
        .arg(&script)
        .arg(&dir)
        .output()
        .expect("running make_spmd.py");
    assert!(
        out.status.success(),
        "make_spmd.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    TempDir(dir)
}

/// Reads a little-endian f32 `.npy` (C order).
fn read_npy(path: &Path) -> Array {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[..6], b"\x93NUMPY", "{}", path.display());
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes(b[8..12].try_into().unwrap()) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&b[start..start + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<f4'"),
        "{}: {header}",
        path.display()
    );
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape = &header[header.find("'shape': (").unwrap() + 10..];
    let shape = &shape[..shape.find(')').unwrap()];
    let dims: Vec<i64> = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    Array::new(&dims, bytes_f32(&b[start + hlen..]))
}

struct Case {
    name: String,
    inputs: usize,
    outputs: usize,
    partitions: usize,
    rtol: f32,
    in_shardings: Vec<String>,
    out_shardings: Vec<String>,
}

fn cases(dir: &Path) -> Vec<Case> {
    std::fs::read_to_string(dir.join("cases.tsv"))
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            let list = |s: &str| s.split(';').map(String::from).collect::<Vec<_>>();
            Case {
                name: f[0].to_string(),
                inputs: f[1].parse().unwrap(),
                outputs: f[2].parse().unwrap(),
                partitions: f[3].parse().unwrap(),
                rtol: f[4].parse().unwrap(),
                in_shardings: list(f[5]),
                out_shardings: list(f[6]),
            }
        })
        .collect()
}

#[test]
fn jax_sharded_programs_give_jaxs_results() {
    let corpus = make_corpus();
    let dir = &corpus.0;
    let c = client4();
    let ids = ids(&c);
    let cases = cases(dir);
    assert!(cases.len() >= 12, "{} cases", cases.len());
    for case in &cases {
        let name = &case.name;
        assert_eq!(case.partitions, 4, "{name}");
        let code = std::fs::read(dir.join(format!("{name}.mlirbc"))).unwrap();
        let exe = c
            .compile(&Program::mlir(code), &CompileOptions::spmd(&ids).unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(exe.num_partitions().unwrap(), 4, "{name}");
        // The shardings XLA chose here are the ones it chose when JAX compiled the function.
        let parse =
            |v: &[String]| -> Vec<HloSharding> { v.iter().map(|s| s.parse().unwrap()).collect() };
        assert_eq!(
            exe.parameter_shardings().unwrap(),
            parse(&case.in_shardings),
            "{name}: parameter shardings {:?}",
            strings(&exe.parameter_shardings().unwrap())
        );
        assert_eq!(
            exe.output_shardings().unwrap(),
            parse(&case.out_shardings),
            "{name}: output shardings {:?}",
            strings(&exe.output_shardings().unwrap())
        );
        let inputs: Vec<Array> = (0..case.inputs)
            .map(|i| read_npy(&dir.join(format!("{name}.in{i}.npy"))))
            .collect();
        let want: Vec<Array> = (0..case.outputs)
            .map(|i| read_npy(&dir.join(format!("{name}.out{i}.npy"))))
            .collect();
        let bufs = split(&c, &exe, &inputs);
        let args: Vec<Vec<&Buffer>> = bufs.iter().map(|l| l.iter().collect()).collect();
        let runs = exe
            .execute_sharded(&args, &[])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(runs.len(), 4);
        let dims: Vec<Vec<i64>> = want.iter().map(|a| a.dims.clone()).collect();
        let got = gather(&exe, runs, &dims);
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            close(&g.data, &w.data, case.rtol, &format!("{name} output {j}"));
        }
        eprintln!(
            "{name}: {} in, {} out on 4 devices; parameters {:?}, outputs {:?}",
            case.inputs, case.outputs, case.in_shardings, case.out_shardings
        );
    }
}
