//! The few `HloModuleProto` fields needed to read an executable's parameter shapes from
//! `PJRT_Executable_OptimizedProgram` (format `"hlo"`).
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
#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleProtoWithConfig {
    #[prost(message, optional, tag = "1")]
    hlo_module: Option<HloModuleProto>,
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

/// Parameter specs of the entry computation of an optimized program: a serialized
/// `HloModuleProto` (format `"hlo"`) or `HloModuleProtoWithConfig` (`"hlo_with_config"`).
///
/// Errors: `Unimplemented` for another format, a tuple parameter or an unsupported element
/// type; `Internal` if the bytes do not decode or lack `host_program_shape`.
pub(crate) fn parameter_specs(format: &str, code: &[u8]) -> Result<Vec<TensorSpec>> {
    let decode_err =
        |e: prost::DecodeError| Error::internal(format!("cannot decode optimized program: {e}"));
    let m = match format {
        "hlo" => HloModuleProto::decode(code).map_err(decode_err)?,
        "hlo_with_config" => HloModuleProtoWithConfig::decode(code)
            .map_err(decode_err)?
            .hlo_module
            .ok_or_else(|| Error::internal("HloModuleProtoWithConfig has no hlo_module"))?,
        other => {
            return Err(Error::unimplemented(format!(
                "optimized program has format {other:?}; expected \"hlo\" or \"hlo_with_config\""
            )));
        }
    };
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
            hlo_module: Some(m.clone()),
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
