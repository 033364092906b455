//! The few `HloModuleProto` fields tpubox reads from `PJRT_Executable_OptimizedProgram` (format
//! `"hlo"`): the parameter shapes, and the facts a host checks before it runs an untrusted
//! program ([`ProgramFacts`]).
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
use crate::types::{PrimitiveType, TensorSpec};

/// `xla.HloModuleProtoWithConfig` (`xla/service/hlo.proto`): `hlo_module = 1`, `config = 2`
/// (skipped). Format `"hlo_with_config"` of the optimized program (seen with API 0.115).
/// `HloModuleProtoWithConfig` with its module left encoded (`hlo_module = 1`).
#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleProtoWithConfig {
    #[prost(bytes = "vec", tag = "1")]
    hlo_module: Vec<u8>,
}

/// The encoded `HloModuleProto` inside an optimized program of `format`.
pub(crate) fn module_bytes<'a>(format: &str, code: &'a [u8]) -> Result<std::borrow::Cow<'a, [u8]>> {
    match format {
        "hlo" => Ok(std::borrow::Cow::Borrowed(code)),
        "hlo_with_config" => {
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
            "optimized program has format {other:?}; expected \"hlo\" or \"hlo_with_config\""
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
}

/// One `while` instruction of an optimized program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WhileLoop {
    /// The instruction's name in the HLO module.
    pub name: String,
    /// The trip count XLA proved for it (`known_trip_count` in the instruction's backend
    /// config, `xla.WhileLoopBackendConfig`), or `None` when XLA could not bound the loop.
    pub known_trip_count: Option<u64>,
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
    for i in m.computations.iter().flat_map(|c| &c.instructions) {
        facts.instructions += 1;
        match i.opcode.as_str() {
            "while" => facts.while_loops.push(WhileLoop {
                name: i.name.clone(),
                known_trip_count: known_trip_count(&i.backend_config),
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
        let ins = |name: &str, opcode: &str, target: &str, config: &str| HloInstructionFacts {
            name: name.into(),
            opcode: opcode.into(),
            custom_call_target: target.into(),
            backend_config: config.as_bytes().to_vec(),
        };
        let m = HloModuleFacts {
            computations: vec![
                HloComputationFacts {
                    instructions: vec![
                        ins("w1", "while", "", r#"{"known_trip_count":{"n":"3"}}"#),
                        ins("w2", "while", "", ""),
                        ins("in", "infeed", "", ""),
                    ],
                },
                HloComputationFacts {
                    instructions: vec![
                        ins("c", "custom-call", "lapack_sgetrf_ffi", ""),
                        ins("c2", "custom-call", "lapack_sgetrf_ffi", ""),
                        ins("a", "add", "", ""),
                    ],
                },
            ],
        };
        let f = program_facts("hlo", &m.encode_to_vec()).unwrap();
        assert_eq!(f.instructions, 6);
        assert_eq!(
            f.while_loops,
            vec![
                WhileLoop {
                    name: "w1".into(),
                    known_trip_count: Some(3)
                },
                WhileLoop {
                    name: "w2".into(),
                    known_trip_count: None
                },
            ]
        );
        assert_eq!(f.host_transfers, vec!["infeed".to_string()]);
        assert_eq!(f.custom_call_targets, vec!["lapack_sgetrf_ffi".to_string()]);
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
