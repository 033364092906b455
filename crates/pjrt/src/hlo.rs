//! The few `HloModuleProto` fields tpubox reads from `PJRT_Executable_OptimizedProgram` (format
//! `"hlo"`): the parameter shapes, and the facts a host checks before it runs an untrusted
//! program ([`ProgramFacts`]).
//!
//! The entry computation's shardings ([`entry_shardings`]) come from `HloModuleProto {
//! spmd_output_sharding = 12; spmd_parameters_shardings = 14; entry_computation_id = 6; }` and
//! `HloComputationProto.root_id = 6`, `HloInstructionProto { parameter_number = 9; sharding =
//! 40; }` (`xla/service/hlo.proto`; `xla.OpSharding` in [`crate::HloSharding`]).
//!
//! More field numbers, from `xla/service/hlo.proto`: `HloModuleProto.computations = 3`,
//! `HloComputationProto.instructions = 2`, `HloInstructionProto { name = 1; opcode = 2;
//! custom_call_target = 28; backend_config = 43; }`.
//!
//! Field numbers: `xla/service/hlo.proto` (`HloModuleProto.host_program_shape = 4`) and
//! `xla/xla_data.proto` (`ProgramShapeProto { parameters = 1; result = 2; }`,
//! `ShapeProto { element_type = 2; dimensions = 3; tuple_shapes = 4; }`, `PrimitiveType`
//! numbering in [`crate::PrimitiveType`]). Unknown fields are skipped by prost.

use prost::Message;

use crate::error::{Error, ErrorCode, Result};
use crate::sharding::{HloSharding, OpShardingProto};
use crate::types::{PrimitiveType, TensorSpec};

/// `xla.HloModuleProtoWithConfig` (`xla/service/hlo.proto`): `hlo_module = 1`, `config = 2`
/// (skipped). Format `"hlo_with_config"` of the optimized program (seen with API 0.115).
/// `HloModuleProtoWithConfig` with its module left encoded (`hlo_module = 1`).
#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleProtoWithConfig {
    #[prost(bytes = "vec", tag = "1")]
    hlo_module: Vec<u8>,
}

/// Format name tpubox uses for a serialized `xla.HloProto` (a module dumped by XLA), accepted
/// wherever a module's format is asked for ([`crate::loop_budget::budget_loops`]); not a
/// program format PJRT compiles.
pub const HLO_PROTO: &str = "hlo_proto";

/// The encoded `HloModuleProto` inside an optimized program of `format`.
pub(crate) fn module_bytes<'a>(format: &str, code: &'a [u8]) -> Result<std::borrow::Cow<'a, [u8]>> {
    match format {
        "hlo" => Ok(std::borrow::Cow::Borrowed(code)),
        // `HloProto { HloModuleProto hlo_module = 1; … }` (`xla/service/hlo.proto`): what
        // XLA's dumps hold (`CompileOptions::dump_hlo_to`); same field as the module of an
        // `HloModuleProtoWithConfig`.
        "hlo_with_config" | HLO_PROTO => {
            let m = HloModuleProtoWithConfig::decode(code)
                .map_err(decode_err)?
                .hlo_module;
            if m.is_empty() {
                return Err(Error::internal(
                    "HloModuleProtoWithConfig has no hlo_module",
                ));
            }
            Ok(std::borrow::Cow::Owned(m))
        }
        other => Err(Error::unimplemented(format!(
            "optimized program has format {other:?}; expected \"hlo\", \"hlo_with_config\" or \"hlo_proto\""
        ))),
    }
}

fn decode_err(e: prost::DecodeError) -> Error {
    Error::internal(format!("cannot decode optimized program: {e}"))
}

#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleProto {
    #[prost(message, optional, tag = "4")]
    host_program_shape: Option<ProgramShapeProto>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProgramShapeProto {
    #[prost(message, repeated, tag = "1")]
    parameters: Vec<ShapeProto>,
    #[prost(message, optional, tag = "2")]
    result: Option<ShapeProto>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ShapeProto {
    #[prost(int32, tag = "2")]
    element_type: i32,
    #[prost(int64, repeated, tag = "3")]
    dimensions: Vec<i64>,
    #[prost(message, repeated, tag = "4")]
    tuple_shapes: Vec<ShapeProto>,
}

/// `xla_data.proto` `PrimitiveType.TUPLE`.
const TUPLE: i32 = 13;

#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleFacts {
    #[prost(message, repeated, tag = "3")]
    computations: Vec<HloComputationFacts>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct HloComputationFacts {
    #[prost(message, repeated, tag = "2")]
    instructions: Vec<HloInstructionFacts>,
    #[prost(int64, tag = "5")]
    id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct HloInstructionFacts {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    opcode: String,
    #[prost(string, tag = "28")]
    custom_call_target: String,
    #[prost(bytes = "vec", tag = "43")]
    backend_config: Vec<u8>,
    #[prost(int64, repeated, tag = "38")]
    called_computation_ids: Vec<i64>,
    #[prost(message, optional, tag = "3")]
    shape: Option<ShapeProto>,
    #[prost(int64, tag = "35")]
    id: i64,
    #[prost(int64, repeated, tag = "36")]
    operand_ids: Vec<i64>,
    #[prost(message, optional, tag = "30")]
    dot_dimension_numbers: Option<DotDimensionNumbers>,
    #[prost(message, optional, tag = "16")]
    convolution_dimension_numbers: Option<ConvolutionDimensionNumbers>,
}

/// `xla.DotDimensionNumbers` (`xla/xla_data.proto`): `lhs_contracting_dimensions = 1`.
#[derive(Clone, PartialEq, prost::Message)]
struct DotDimensionNumbers {
    #[prost(int64, repeated, tag = "1")]
    lhs_contracting_dimensions: Vec<i64>,
}

/// `xla.ConvolutionDimensionNumbers` (`xla/xla_data.proto`):
/// `kernel_output_feature_dimension = 4`.
#[derive(Clone, PartialEq, prost::Message)]
struct ConvolutionDimensionNumbers {
    #[prost(int64, tag = "4")]
    kernel_output_feature_dimension: i64,
}

/// One `while` instruction of an optimized program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WhileLoop {
    /// The instruction's name in the HLO module.
    pub name: String,
    /// The trip count XLA proved for it (`known_trip_count` in the instruction's backend
    /// config, `xla.WhileLoopBackendConfig`), or `None` when XLA could not bound the loop.
    pub known_trip_count: Option<u64>,
    /// Whether the loop's condition calls the loop budget
    /// ([`crate::loop_budget::LOOP_BUDGET_TARGET`]), itself or through any computation it
    /// calls (a fusion, a call): then every trip asks the budget first.
    pub budgeted: bool,
    /// Work one trip stands for, in the loop budget's units, at least 1: the body's and
    /// condition's operations plus bytes written, estimated from the optimized program
    /// (docs/SECURITY.md, "Loops the compiler cannot bound").
    pub trip_work: u64,
}

/// What an optimized program contains that matters to a host sharing a device: loops that may
/// not end, transfers to and from the host (which block until someone feeds them), and custom
/// calls (code outside XLA).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgramFacts {
    /// Instructions over all computations.
    pub instructions: u64,
    /// Every `while` instruction.
    pub while_loops: Vec<WhileLoop>,
    /// Opcodes of host-transfer instructions present (`infeed`, `outfeed`, `send`, `recv`,
    /// and their `-done` halves), each once, sorted.
    pub host_transfers: Vec<String>,
    /// Targets of the `custom-call` instructions, each once, sorted.
    pub custom_call_targets: Vec<String>,
}

/// Reads the `"n"` of `"known_trip_count"` from a while loop's JSON backend config, e.g.
/// `{"known_trip_count":{"n":"10"}}`.
pub(crate) fn known_trip_count(config: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(config).ok()?;
    let rest = &text[text.find("\"known_trip_count\"")?..];
    let rest = &rest[rest.find("\"n\"")? + 3..];
    let digits: String = rest
        .trim_start_matches([':', ' ', '"'])
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

pub(crate) fn program_facts(format: &str, code: &[u8]) -> Result<ProgramFacts> {
    let m = HloModuleFacts::decode(&*module_bytes(format, code)?).map_err(decode_err)?;
    let mut facts = ProgramFacts::default();
    let mut transfers = std::collections::BTreeSet::new();
    let mut targets = std::collections::BTreeSet::new();
    let budgeted = budgeted_computations(&m);
    let mut work = Work::new(&m);
    for i in m.computations.iter().flat_map(|c| &c.instructions) {
        facts.instructions += 1;
        match i.opcode.as_str() {
            "while" => facts.while_loops.push(WhileLoop {
                name: i.name.clone(),
                known_trip_count: known_trip_count(&i.backend_config),
                // `called_computation_ids` of a while are `[body, condition]`
                // (crate::loop_budget's module docs).
                budgeted: i
                    .called_computation_ids
                    .get(1)
                    .is_some_and(|c| budgeted.contains(c)),
                trip_work: trip_work(&mut work, i),
            }),
            "custom-call" => {
                targets.insert(i.custom_call_target.clone());
            }
            op @ ("infeed" | "outfeed" | "send" | "send-done" | "recv" | "recv-done") => {
                transfers.insert(op.to_string());
            }
            _ => {}
        }
    }
    facts.host_transfers = transfers.into_iter().collect();
    facts.custom_call_targets = targets.into_iter().collect();
    Ok(facts)
}

/// Elements of a shape (a tuple's: the sum of its members'), as a float (no overflow).
fn elements(s: &ShapeProto) -> f64 {
    if s.element_type == TUPLE || !s.tuple_shapes.is_empty() {
        return s.tuple_shapes.iter().map(elements).sum();
    }
    s.dimensions.iter().map(|d| (*d).max(0) as f64).product()
}

/// Bytes of a shape (a tuple's: the sum of its members'); 4 per element for a type this crate
/// does not name.
fn shape_bytes(s: &ShapeProto) -> f64 {
    if s.element_type == TUPLE || !s.tuple_shapes.is_empty() {
        return s.tuple_shapes.iter().map(shape_bytes).sum();
    }
    let size = PrimitiveType::from_xla_proto(s.element_type).map_or(4, |t| t.byte_size());
    elements(s) * size as f64
}

/// Work estimates of a module's computations (see [`trip_work`]), memoized; a
/// computation being estimated counts 0 where it calls itself (a cycle in a hostile module).
struct Work<'m> {
    by_id: std::collections::HashMap<i64, &'m HloComputationFacts>,
    done: std::collections::HashMap<i64, f64>,
}

impl<'m> Work<'m> {
    fn new(m: &'m HloModuleFacts) -> Self {
        Self {
            by_id: m.computations.iter().map(|c| (c.id, c)).collect(),
            done: std::collections::HashMap::new(),
        }
    }

    fn computation(&mut self, id: i64) -> f64 {
        if let Some(w) = self.done.get(&id) {
            return *w;
        }
        let Some(c) = self.by_id.get(&id).copied() else {
            return 0.0;
        };
        self.done.insert(id, 0.0);
        let shapes: std::collections::HashMap<i64, &ShapeProto> = c
            .instructions
            .iter()
            .filter_map(|i| i.shape.as_ref().map(|s| (i.id, s)))
            .collect();
        let mut total = 0.0;
        for i in &c.instructions {
            total += self.instruction(i, &shapes);
        }
        self.done.insert(id, total);
        total
    }

    fn called(&mut self, i: &HloInstructionFacts) -> f64 {
        i.called_computation_ids
            .iter()
            .map(|c| self.computation(*c))
            .sum()
    }

    /// One instruction: the bytes it writes plus one operation per result element, plus what
    /// its kind adds (a dot's or convolution's multiply-adds, a called computation's work).
    fn instruction(
        &mut self,
        i: &HloInstructionFacts,
        shapes: &std::collections::HashMap<i64, &ShapeProto>,
    ) -> f64 {
        let out = i.shape.as_ref().map_or(0.0, elements);
        let base = i.shape.as_ref().map_or(0.0, shape_bytes) + out;
        let operand = |k: usize| i.operand_ids.get(k).and_then(|o| shapes.get(o)).copied();
        let operands_elements: f64 = i
            .operand_ids
            .iter()
            .filter_map(|o| shapes.get(o))
            .map(|s| elements(s))
            .sum();
        let extra = match i.opcode.as_str() {
            "dot" => {
                let k: f64 = match (operand(0), &i.dot_dimension_numbers) {
                    (Some(lhs), Some(d)) => d
                        .lhs_contracting_dimensions
                        .iter()
                        .filter_map(|x| usize::try_from(*x).ok())
                        .filter_map(|x| lhs.dimensions.get(x))
                        .map(|n| (*n).max(0) as f64)
                        .product(),
                    _ => operands_elements,
                };
                2.0 * out * k
            }
            "convolution" => {
                let per_output = match (operand(1), &i.convolution_dimension_numbers) {
                    (Some(k), Some(d)) => {
                        let features = usize::try_from(d.kernel_output_feature_dimension)
                            .ok()
                            .and_then(|x| k.dimensions.get(x))
                            .map_or(1.0, |n| (*n).max(1) as f64);
                        elements(k) / features
                    }
                    _ => operands_elements,
                };
                2.0 * out * per_output
            }
            "while" => {
                let trips = known_trip_count(&i.backend_config).map_or(1.0, |n| n as f64);
                self.called(i) * trips
            }
            // A computation applied per element (or per pair, for a sort's comparator).
            "reduce" | "reduce-window" | "map" | "scatter" | "select-and-scatter"
            | "all-reduce" | "reduce-scatter" => operands_elements * self.called(i).max(1.0),
            "sort" => {
                let n = operands_elements.max(2.0);
                n * n.log2().ceil() * self.called(i).max(1.0)
            }
            _ => self.called(i),
        };
        base + extra
    }
}

/// Work one trip of the `while` loop `w` stands for, in the loop budget's units: its body's and
/// condition's estimated floating-point operations plus bytes written (each instruction: its
/// result's bytes and one operation per element; a dot 2·M·N·K more, a convolution 2 per
/// multiply-add; a fusion or call its computation's work; a reduce, map or scatter its
/// operands' elements times its applied computation's work; a sort n·⌈log₂ n⌉ comparisons; a
/// nested loop its body's work times its known trip count, or once when it has none, since
/// such a loop draws from the budget itself); at least 1, `u64::MAX` past it. XLA's own cost
/// analysis is not used because a CPU plugin may not report it (`lammps-jax-pjrt-cpu` 0.11.2
/// answers `PJRT_Executable_GetCostAnalysis` with UNIMPLEMENTED).
fn trip_work(work: &mut Work<'_>, w: &HloInstructionFacts) -> u64 {
    let units = work.called(w);
    if units.is_finite() && units < u64::MAX as f64 {
        (units as u64).max(1)
    } else {
        u64::MAX
    }
}

/// Ids of the computations of `m` that call the loop budget's custom call, directly or
/// through the computations they call (a fixed point over the call graph, so a cycle in a
/// hostile module ends).
fn budgeted_computations(m: &HloModuleFacts) -> std::collections::HashSet<i64> {
    let target = crate::loop_budget::LOOP_BUDGET_TARGET;
    let mut set: std::collections::HashSet<i64> = m
        .computations
        .iter()
        .filter(|c| {
            c.instructions
                .iter()
                .any(|i| i.opcode == "custom-call" && i.custom_call_target == target)
        })
        .map(|c| c.id)
        .collect();
    loop {
        let before = set.len();
        for c in &m.computations {
            if !set.contains(&c.id)
                && c.instructions
                    .iter()
                    .any(|i| i.called_computation_ids.iter().any(|x| set.contains(x)))
            {
                set.insert(c.id);
            }
        }
        if set.len() == before {
            return set;
        }
    }
}

/// Parameter specs of the entry computation of an optimized program: a serialized
/// `HloModuleProto` (format `"hlo"`) or `HloModuleProtoWithConfig` (`"hlo_with_config"`).
///
/// Errors: `Unimplemented` for another format, a tuple parameter or an unsupported element
/// type; `Internal` if the bytes do not decode or lack `host_program_shape`.
pub(crate) fn parameter_specs(format: &str, code: &[u8]) -> Result<Vec<TensorSpec>> {
    let m = HloModuleProto::decode(&*module_bytes(format, code)?).map_err(decode_err)?;
    let shape = m
        .host_program_shape
        .ok_or_else(|| Error::internal("optimized HloModuleProto has no host_program_shape"))?;
    shape
        .parameters
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if p.element_type == TUPLE || !p.tuple_shapes.is_empty() {
                return Err(Error::new(
                    ErrorCode::Unimplemented,
                    format!("parameter {i} is a tuple; only array parameters are supported"),
                ));
            }
            let ty = PrimitiveType::from_xla_proto(p.element_type).ok_or_else(|| {
                Error::new(
                    ErrorCode::Unimplemented,
                    format!(
                        "parameter {i} has unsupported XLA element type {}",
                        p.element_type
                    ),
                )
            })?;
            Ok(TensorSpec {
                ty,
                dims: p.dimensions.clone(),
            })
        })
        .collect()
}

/// `HloModuleProto` with what records the entry computation's shardings: `computations = 3`,
/// `host_program_shape = 4`, `entry_computation_id = 6`, `spmd_output_sharding = 12`,
/// `spmd_parameters_shardings = 14` (`xla/service/hlo.proto`).
#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleShardings {
    #[prost(message, repeated, tag = "3")]
    computations: Vec<HloComputationShardings>,
    #[prost(message, optional, tag = "4")]
    host_program_shape: Option<ProgramShapeProto>,
    #[prost(int64, tag = "6")]
    entry_computation_id: i64,
    #[prost(message, optional, tag = "12")]
    spmd_output_sharding: Option<OpShardingProto>,
    #[prost(message, repeated, tag = "14")]
    spmd_parameters_shardings: Vec<OpShardingProto>,
}

/// `HloComputationProto { instructions = 2; id = 5; root_id = 6; }`.
#[derive(Clone, PartialEq, prost::Message)]
struct HloComputationShardings {
    #[prost(message, repeated, tag = "2")]
    instructions: Vec<HloInstructionSharding>,
    #[prost(int64, tag = "5")]
    id: i64,
    #[prost(int64, tag = "6")]
    root_id: i64,
}

/// `HloInstructionProto { opcode = 2; parameter_number = 9; id = 35; sharding = 40; }`.
#[derive(Clone, PartialEq, prost::Message)]
struct HloInstructionSharding {
    #[prost(string, tag = "2")]
    opcode: String,
    #[prost(int64, tag = "9")]
    parameter_number: i64,
    #[prost(int64, tag = "35")]
    id: i64,
    #[prost(message, optional, tag = "40")]
    sharding: Option<OpShardingProto>,
}

/// The entry computation's shardings and per-device shapes, from an optimized program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryShardings {
    pub(crate) parameters: Vec<HloSharding>,
    pub(crate) outputs: Vec<HloSharding>,
    pub(crate) output_specs: Vec<TensorSpec>,
}

/// Shardings of the entry computation's parameters and outputs (one per output: the elements
/// of a tuple result), and the per-device output shapes (`host_program_shape.result`, untupled).
///
/// Where XLA recorded them: `spmd_parameters_shardings` and `spmd_output_sharding`, which XLA's
/// SPMD partitioner sets to the entry's shardings before it partitions; else the `sharding` of
/// the entry computation's parameter and root instructions; else (a program over one device,
/// or an array XLA left without a sharding) replicated. A single sharding recorded for a tuple
/// result applies to each of its elements.
///
/// Errors: as [`parameter_specs`]; `Internal` if the module does not decode or a recorded
/// sharding is invalid or does not match the number of parameters or outputs.
pub(crate) fn entry_shardings(format: &str, code: &[u8]) -> Result<EntryShardings> {
    let m = HloModuleShardings::decode(&*module_bytes(format, code)?).map_err(decode_err)?;
    let shape = m
        .host_program_shape
        .as_ref()
        .ok_or_else(|| Error::internal("optimized HloModuleProto has no host_program_shape"))?;
    let nparams = shape.parameters.len();
    let result = shape
        .result
        .as_ref()
        .ok_or_else(|| Error::internal("optimized HloModuleProto has no result shape"))?;
    let tuple_result = result.element_type == TUPLE || !result.tuple_shapes.is_empty();
    let results: Vec<&ShapeProto> = if tuple_result {
        result.tuple_shapes.iter().collect()
    } else {
        vec![result]
    };
    let output_specs = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let ty = PrimitiveType::from_xla_proto(r.element_type).ok_or_else(|| {
                Error::unimplemented(format!(
                    "output {i} has unsupported XLA element type {}",
                    r.element_type
                ))
            })?;
            Ok(TensorSpec {
                ty,
                dims: r.dimensions.clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let bad = |what: &str, e: Error| {
        Error::internal(format!("optimized program's {what}: {}", e.message))
    };
    let entry = m
        .computations
        .iter()
        .find(|c| c.id == m.entry_computation_id)
        .or(m.computations.last());

    let parameters = if !m.spmd_parameters_shardings.is_empty() {
        if m.spmd_parameters_shardings.len() != nparams {
            return Err(Error::internal(format!(
                "optimized program records {} parameter shardings for {nparams} parameters",
                m.spmd_parameters_shardings.len()
            )));
        }
        m.spmd_parameters_shardings
            .iter()
            .map(|p| HloSharding::from_proto(p).map_err(|e| bad("parameter sharding", e)))
            .collect::<Result<Vec<_>>>()?
    } else {
        let mut v = vec![HloSharding::Replicated; nparams];
        for i in entry.iter().flat_map(|c| &c.instructions) {
            if i.opcode != "parameter" {
                continue;
            }
            let slot = usize::try_from(i.parameter_number)
                .ok()
                .and_then(|n| v.get_mut(n));
            if let (Some(slot), Some(s)) = (slot, &i.sharding) {
                *slot = HloSharding::from_proto(s).map_err(|e| bad("parameter sharding", e))?;
            }
        }
        v
    };

    let recorded = match &m.spmd_output_sharding {
        Some(s) => Some(s),
        None => entry.and_then(|c| {
            c.instructions
                .iter()
                .find(|i| i.id == c.root_id)
                .and_then(|i| i.sharding.as_ref())
        }),
    };
    let outputs = match recorded {
        None => vec![HloSharding::Replicated; results.len()],
        Some(s) => match HloSharding::from_proto(s).map_err(|e| bad("output sharding", e))? {
            HloSharding::Tuple(v) if tuple_result => {
                if v.len() != results.len() {
                    return Err(Error::internal(format!(
                        "optimized program records {} output shardings for {} outputs",
                        v.len(),
                        results.len()
                    )));
                }
                v
            }
            HloSharding::Tuple(v) => match <[HloSharding; 1]>::try_from(v) {
                Ok([one]) => vec![one],
                Err(v) => {
                    return Err(Error::internal(format!(
                        "optimized program records {} output shardings for one output",
                        v.len()
                    )));
                }
            },
            one => vec![one; results.len()],
        },
    };
    Ok(EntryShardings {
        parameters,
        outputs,
        output_specs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_known_trip_counts() {
        assert_eq!(
            known_trip_count(br#"{"known_trip_count":{"n":"10"}}"#),
            Some(10)
        );
        assert_eq!(
            known_trip_count(br#"{"known_trip_count": {"n": "7"}, "x": 1}"#),
            Some(7)
        );
        assert_eq!(known_trip_count(b""), None);
        assert_eq!(known_trip_count(br#"{"known_init_step":{}}"#), None);
    }

    #[test]
    fn facts_of_a_hand_built_module() {
        let ins = |name: &str, opcode: &str, target: &str, config: &str, called: &[i64]| {
            HloInstructionFacts {
                name: name.into(),
                opcode: opcode.into(),
                custom_call_target: target.into(),
                backend_config: config.as_bytes().to_vec(),
                called_computation_ids: called.to_vec(),
                ..Default::default()
            }
        };
        let budget = crate::loop_budget::LOOP_BUDGET_TARGET;
        let m = HloModuleFacts {
            computations: vec![
                HloComputationFacts {
                    id: 1,
                    instructions: vec![
                        ins(
                            "w1",
                            "while",
                            "",
                            r#"{"known_trip_count":{"n":"3"}}"#,
                            &[2, 2],
                        ),
                        ins("w2", "while", "", "", &[2, 3]),
                        ins("w3", "while", "", "", &[2, 2]),
                        ins("in", "infeed", "", "", &[]),
                    ],
                },
                HloComputationFacts {
                    id: 2,
                    instructions: vec![
                        ins("c", "custom-call", "lapack_sgetrf_ffi", "", &[]),
                        ins("c2", "custom-call", "lapack_sgetrf_ffi", "", &[]),
                        ins("a", "add", "", "", &[]),
                    ],
                },
                // A condition that reaches the budget through a fusion (and a cycle).
                HloComputationFacts {
                    id: 3,
                    instructions: vec![ins("f", "fusion", "", "", &[4])],
                },
                HloComputationFacts {
                    id: 4,
                    instructions: vec![
                        ins("b", "custom-call", budget, "", &[]),
                        ins("k", "call", "", "", &[3]),
                    ],
                },
            ],
        };
        let f = program_facts("hlo", &m.encode_to_vec()).unwrap();
        assert_eq!(f.instructions, 10);
        assert_eq!(
            f.while_loops,
            vec![
                WhileLoop {
                    name: "w1".into(),
                    known_trip_count: Some(3),
                    budgeted: false,
                    trip_work: 1,
                },
                WhileLoop {
                    name: "w2".into(),
                    known_trip_count: None,
                    budgeted: true,
                    trip_work: 1,
                },
                WhileLoop {
                    name: "w3".into(),
                    known_trip_count: None,
                    budgeted: false,
                    trip_work: 1,
                },
            ]
        );
        assert_eq!(f.host_transfers, vec!["infeed".to_string()]);
        assert_eq!(
            f.custom_call_targets,
            vec!["lapack_sgetrf_ffi".to_string(), budget.to_string()]
        );
    }

    #[test]
    fn work_of_a_loop_over_a_matmul() {
        let f32s = |dims: &[i64]| ShapeProto {
            element_type: 11, // F32
            dimensions: dims.to_vec(),
            tuple_shapes: vec![],
        };
        let ins =
            |id: i64, opcode: &str, shape: ShapeProto, operands: &[i64]| HloInstructionFacts {
                name: format!("{opcode}.{id}"),
                opcode: opcode.into(),
                id,
                shape: Some(shape),
                operand_ids: operands.to_vec(),
                ..Default::default()
            };
        // body (2): p = f32[8,16], q = f32[16,4], dot contracting p's dim 1 -> f32[8,4]
        let mut dot = ins(3, "dot", f32s(&[8, 4]), &[1, 2]);
        dot.dot_dimension_numbers = Some(DotDimensionNumbers {
            lhs_contracting_dimensions: vec![1],
        });
        let body = HloComputationFacts {
            id: 2,
            instructions: vec![
                ins(1, "parameter", f32s(&[8, 16]), &[]),
                ins(2, "parameter", f32s(&[16, 4]), &[]),
                dot,
            ],
        };
        let cond = HloComputationFacts {
            id: 3,
            instructions: vec![ins(4, "constant", f32s(&[]), &[])],
        };
        let mut w = ins(5, "while", f32s(&[8, 4]), &[]);
        w.called_computation_ids = vec![2, 3];
        let mut bounded = w.clone();
        bounded.name = "bounded".into();
        bounded.backend_config = br#"{"known_trip_count":{"n":"10"}}"#.to_vec();
        let mut outer = ins(6, "while", f32s(&[8, 4]), &[]);
        outer.called_computation_ids = vec![4, 3];
        let outer_body = HloComputationFacts {
            id: 4,
            instructions: vec![bounded],
        };
        let entry = HloComputationFacts {
            id: 1,
            instructions: vec![w, outer],
        };
        let m = HloModuleFacts {
            computations: vec![entry, body, cond, outer_body],
        };
        let facts = program_facts("hlo", &m.encode_to_vec()).unwrap();
        let work: std::collections::HashMap<&str, u64> = facts
            .while_loops
            .iter()
            .map(|w| (w.name.as_str(), w.trip_work))
            .collect();
        // parameters 8·16 and 16·4 elements (5 units each: 4 bytes + 1), the dot 32 elements
        // (5 units each) + 2·32·16 multiply-adds, the condition's constant 5.
        let one = (128 * 5 + 64 * 5 + 32 * 5 + 2 * 32 * 16 + 5) as u64;
        assert_eq!(work["while.5"], one);
        // The outer loop's body is the bounded loop (its own f32[8,4] result, 32·5, and its
        // 10 trips); its condition counts once.
        assert_eq!(work["while.6"], 10 * one + 32 * 5 + 5);
        assert_eq!(work["bounded"], one);
    }

    #[test]
    fn entry_shardings_from_each_place_xla_records_them() {
        let f32s = |dims: &[i64]| ShapeProto {
            element_type: 11,
            dimensions: dims.to_vec(),
            tuple_shapes: vec![],
        };
        let tuple = |v: Vec<ShapeProto>| ShapeProto {
            element_type: TUPLE,
            dimensions: vec![],
            tuple_shapes: v,
        };
        let rows = OpShardingProto {
            r#type: 3,
            tile_assignment_dimensions: vec![4, 1],
            iota_reshape_dims: vec![4],
            ..Default::default()
        };
        let maximal = OpShardingProto {
            r#type: 1,
            tile_assignment_devices: vec![2],
            ..Default::default()
        };
        let shape = ProgramShapeProto {
            parameters: vec![f32s(&[2, 3]), f32s(&[8, 3])],
            result: Some(tuple(vec![f32s(&[2, 3]), f32s(&[])])),
        };
        let text = |v: &[HloSharding]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // The module's spmd_* fields.
        let m = HloModuleShardings {
            host_program_shape: Some(shape.clone()),
            spmd_parameters_shardings: vec![rows.clone(), OpShardingProto::default()],
            spmd_output_sharding: Some(OpShardingProto {
                r#type: 2,
                tuple_shardings: vec![rows.clone(), maximal.clone()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = entry_shardings("hlo", &m.encode_to_vec()).unwrap();
        assert_eq!(
            text(&e.parameters),
            ["{devices=[4,1]<=[4]}", "{replicated}"]
        );
        assert_eq!(
            text(&e.outputs),
            ["{devices=[4,1]<=[4]}", "{maximal device=2}"]
        );
        assert_eq!(
            e.output_specs,
            [
                TensorSpec {
                    ty: PrimitiveType::F32,
                    dims: vec![2, 3]
                },
                TensorSpec {
                    ty: PrimitiveType::F32,
                    dims: vec![]
                }
            ]
        );
        // The entry computation's parameter and root instructions; one sharding for the
        // whole tuple applies to each element.
        let ins =
            |id: i64, opcode: &str, n: i64, s: Option<&OpShardingProto>| HloInstructionSharding {
                opcode: opcode.into(),
                parameter_number: n,
                id,
                sharding: s.cloned(),
            };
        let m = HloModuleShardings {
            host_program_shape: Some(shape.clone()),
            entry_computation_id: 7,
            computations: vec![
                HloComputationShardings {
                    id: 7,
                    root_id: 3,
                    instructions: vec![
                        ins(1, "parameter", 1, Some(&rows)),
                        ins(2, "parameter", 0, None),
                        ins(3, "tuple", 0, Some(&maximal)),
                    ],
                },
                HloComputationShardings {
                    id: 8,
                    root_id: 4,
                    instructions: vec![ins(4, "parameter", 0, Some(&maximal))],
                },
            ],
            ..Default::default()
        };
        let e = entry_shardings("hlo", &m.encode_to_vec()).unwrap();
        assert_eq!(
            text(&e.parameters),
            ["{replicated}", "{devices=[4,1]<=[4]}"]
        );
        assert_eq!(
            text(&e.outputs),
            ["{maximal device=2}", "{maximal device=2}"]
        );
        // Nothing recorded: replicated; a single result.
        let one = HloModuleShardings {
            host_program_shape: Some(ProgramShapeProto {
                parameters: vec![f32s(&[3])],
                result: Some(f32s(&[3])),
            }),
            ..Default::default()
        };
        let e = entry_shardings("hlo", &one.encode_to_vec()).unwrap();
        assert_eq!(e.parameters, [HloSharding::Replicated]);
        assert_eq!(e.outputs, [HloSharding::Replicated]);
        // Counts that disagree, and an invalid sharding.
        let mut bad = m.clone();
        bad.spmd_parameters_shardings = vec![rows.clone()];
        let mut bad_tuple = m.clone();
        bad_tuple.spmd_output_sharding = Some(OpShardingProto {
            r#type: 2,
            tuple_shardings: vec![rows.clone()],
            ..Default::default()
        });
        let mut invalid = m.clone();
        invalid.spmd_parameters_shardings = vec![
            maximal.clone(),
            OpShardingProto {
                r#type: 3,
                tile_assignment_dimensions: vec![2],
                tile_assignment_devices: vec![0, 1, 2],
                ..Default::default()
            },
        ];
        for b in [bad, bad_tuple, invalid] {
            let e = entry_shardings("hlo", &b.encode_to_vec()).unwrap_err();
            assert_eq!(e.code, ErrorCode::Internal, "{e}");
        }
    }

    #[test]
    fn decodes_hand_built_module() {
        let m = HloModuleProto {
            host_program_shape: Some(ProgramShapeProto {
                parameters: vec![
                    ShapeProto {
                        element_type: 11,
                        dimensions: vec![2, 3],
                        tuple_shapes: vec![],
                    },
                    ShapeProto {
                        element_type: 16,
                        dimensions: vec![],
                        tuple_shapes: vec![],
                    },
                ],
                result: None,
            }),
        };
        let specs = parameter_specs("hlo", &m.encode_to_vec()).unwrap();
        let wrapped = HloModuleProtoWithConfig {
            hlo_module: m.encode_to_vec(),
        };
        assert_eq!(
            parameter_specs("hlo_with_config", &wrapped.encode_to_vec()).unwrap(),
            specs
        );
        assert!(parameter_specs("mlir", &[]).is_err());
        assert_eq!(
            specs,
            vec![
                TensorSpec {
                    ty: PrimitiveType::F32,
                    dims: vec![2, 3]
                },
                TensorSpec {
                    ty: PrimitiveType::Bf16,
                    dims: vec![]
                }
            ]
        );
        let t = HloModuleProto {
            host_program_shape: Some(ProgramShapeProto {
                parameters: vec![ShapeProto {
                    element_type: TUPLE,
                    ..Default::default()
                }],
                result: None,
            }),
        };
        assert_eq!(
            parameter_specs("hlo", &t.encode_to_vec()).unwrap_err().code,
            ErrorCode::Unimplemented
        );
    }
}
