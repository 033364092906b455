//! Shared helpers for the integration tests: plugin lookup, clients, byte conversions.
#![allow(dead_code)]

use std::path::PathBuf;

use pjrt::{Client, Device, NamedValue, Plugin, PrimitiveType};

/// Default plugin (PJRT C API 0.115), overridable with `TPUBOX_PJRT_PLUGIN`.
pub const DEFAULT_PLUGIN: &str =
    ".cache/tpubox/plugins/lammps-jax-pjrt-cpu-0.11.2/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so";
/// The OpenXLA CPU plugin (PJRT C API 0.81).
pub const XLA_CPU_PLUGIN: &str =
    ".cache/tpubox/plugins/xla-cpu-pjrt-0.0.1/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so";

fn cache_path(rel: &str) -> PathBuf {
    let rel = rel.trim_start_matches(".cache/tpubox/");
    match std::env::var_os("TPUBOX_CACHE_DIR") {
        Some(d) => PathBuf::from(d).join(rel),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/tpubox")
            .join(rel),
    }
}

pub fn plugin_path() -> PathBuf {
    match std::env::var_os("TPUBOX_PJRT_PLUGIN") {
        Some(p) => PathBuf::from(p),
        None => cache_path(DEFAULT_PLUGIN),
    }
}

pub fn load(path: PathBuf) -> Plugin {
    assert!(
        path.is_file(),
        "PJRT plugin {} not found: run `bash scripts/dev.sh setup` or set TPUBOX_PJRT_PLUGIN",
        path.display()
    );
    Plugin::load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

pub fn plugin() -> Plugin {
    load(plugin_path())
}

pub fn xla_cpu_plugin_path() -> PathBuf {
    cache_path(XLA_CPU_PLUGIN)
}

/// A client with 2 CPU devices.
pub fn client() -> Client {
    Client::new(&plugin(), &[("cpu_device_count", NamedValue::Int64(2))]).expect("client")
}

pub fn dev0(c: &Client) -> Device {
    c.devices()
        .expect("devices")
        .into_iter()
        .next()
        .expect("a device")
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_i32(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `n` elements of type `ty` with distinct, valid (non-NaN) values, as little-endian bytes.
pub fn sample_bytes(ty: PrimitiveType, n: usize) -> Vec<u8> {
    use PrimitiveType::*;
    let mut out = Vec::new();
    for i in 0..n {
        let x = i as f64 * 1.5 - 3.0;
        match ty {
            Pred => out.push((i % 2) as u8),
            S8 => out.extend((i as i8).wrapping_mul(-7).to_le_bytes()),
            U8 => out.extend((i as u8).wrapping_mul(37).to_le_bytes()),
            S16 => out.extend((i as i16 * -1000).to_le_bytes()),
            U16 => out.extend((i as u16 * 5003).to_le_bytes()),
            S32 => out.extend((i as i32 * -100_003).to_le_bytes()),
            U32 => out.extend((i as u32 * 4_000_037).to_le_bytes()),
            S64 => out.extend((i as i64 * -9_000_000_000_017).to_le_bytes()),
            U64 => out.extend((i as u64 * 9_000_000_000_017).to_le_bytes()),
            F16 => out.extend(half::f16::from_f64(x).to_le_bytes()),
            Bf16 => out.extend(half::bf16::from_f64(x).to_le_bytes()),
            F32 => out.extend((x as f32).to_le_bytes()),
            F64 => out.extend(x.to_le_bytes()),
            C64 => {
                out.extend((x as f32).to_le_bytes());
                out.extend((-x as f32).to_le_bytes());
            }
            C128 => {
                out.extend(x.to_le_bytes());
                out.extend((x * 2.0).to_le_bytes());
            }
        }
    }
    assert_eq!(out.len(), n * ty.byte_size());
    out
}

pub const ADD_2X2: &str = r#"
module @add {
  func.func public @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
    %0 = stablehlo.add %a, %b : tensor<2x2xf32>
    return %0 : tensor<2x2xf32>
  }
}
"#;
