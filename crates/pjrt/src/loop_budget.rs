//! Rewrites an HLO module so that `while` loops XLA cannot bound ask a budget before each
//! trip: [`budget_loops`]. The host rewrites the module XLA dumped *before* its passes
//! ([`crate::CompileOptions::dump_hlo_to`]), picking the loops the optimized program could not
//! bound, and compiles the result again (an optimized module does not compile again on the
//! CPU plugins: its fusions abort XLA's CPU emitter).
//!
//! The rewrite edits a serialized `xla.HloModuleProto` at the protobuf wire level: fields it
//! does not touch are copied as raw bytes, so nothing of the module is lost to a partial
//! decoder. For each unbounded loop's condition computation it appends two instructions and
//! makes the second one the root:
//!
//! ```text
//! budget = pred[] custom-call(), custom_call_target="tpubox_loop_budget",
//!          custom_call_has_side_effect=true, api_version=API_VERSION_TYPED_FFI,
//!          backend_config={iterations = N : i64, work = W : i64, step = S : i64}
//! root'  = pred[] and(root, budget)
//! ```
//!
//! The custom call's handler (crate `tpubox-pjrt-kernels`) counts, per execution, every
//! condition evaluation of every budgeted loop and the work `step` each stands for; it returns
//! `true` while the execution is within `iterations` and `work`, and fails the execution with
//! `RESOURCE_EXHAUSTED` once it is not. The loop thus ends when its own condition says so, or
//! the execution fails: it never stops early with a result returned as if right.
//!
//! Field numbers, from `xla/service/hlo.proto`: `HloModuleProto { computations = 3;
//! schedule = 7; }`, `HloComputationProto { instructions = 2; root_id = 6; id = 5; }`,
//! `HloInstructionProto { name = 1; opcode = 2; shape = 3; custom_call_target = 28; id = 35;
//! operand_ids = 36; called_computation_ids = 38; backend_config = 43;
//! custom_call_has_side_effect = 65; custom_call_api_version = 77; }`
//! (`CustomCallApiVersion.API_VERSION_TYPED_FFI = 4`). A `while` instruction's
//! `called_computation_ids` are `[body, condition]` (XLA's
//! `HloWhileInstruction` appends the body first). The module's `schedule` is dropped: the
//! rewritten module is compiled again from the start, and a schedule without the new
//! instructions would not verify.

use prost::encoding::{WireType, decode_key, decode_varint, encode_key, encode_varint};

use crate::error::{Error, ErrorCode, Result};

/// Custom-call target of the loop budget (registered by `tpubox-pjrt-kernels`).
pub const LOOP_BUDGET_TARGET: &str = "tpubox_loop_budget";

/// The budget a rewritten program's loops draw from, per execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoopBudget {
    /// Most condition evaluations of budgeted loops in one execution, all loops together
    /// (`max-loop-iterations`).
    pub iterations: u64,
    /// Most work in one execution, all budgeted loops together, in the units of `step`
    /// (`max-loop-work`).
    pub work: u64,
    /// Work one condition evaluation stands for (the cost of one trip of the loop: see the
    /// caller's estimate), at least 1.
    pub step: u64,
}

/// The bits of an instruction id XLA keys instructions by within their computation.
const LOCAL_ID: i64 = 0xffff_ffff;

/// One field of a message: its number, wire type and the whole encoded field (key included).
struct Field<'a> {
    number: u32,
    wire: WireType,
    /// The field's payload: the value bytes of a length-delimited field, else the encoded
    /// value without its key.
    payload: &'a [u8],
    /// The whole field as encoded, key included.
    raw: &'a [u8],
}

fn bad(what: &str) -> Error {
    Error::internal(format!(
        "cannot rewrite the program for the loop budget: {what}"
    ))
}

/// Splits an encoded message into its fields, in order.
fn fields(mut buf: &[u8]) -> Result<Vec<Field<'_>>> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let start = buf;
        let (number, wire) = decode_key(&mut buf).map_err(|e| bad(&e.to_string()))?;
        let payload: &[u8] = match wire {
            WireType::Varint => {
                let before = buf;
                decode_varint(&mut buf).map_err(|e| bad(&e.to_string()))?;
                &before[..before.len() - buf.len()]
            }
            WireType::SixtyFourBit | WireType::ThirtyTwoBit => {
                let n = if wire == WireType::SixtyFourBit { 8 } else { 4 };
                if buf.len() < n {
                    return Err(bad("truncated fixed-width field"));
                }
                let (v, rest) = buf.split_at(n);
                buf = rest;
                v
            }
            WireType::LengthDelimited => {
                let len = decode_varint(&mut buf).map_err(|e| bad(&e.to_string()))?;
                let len = usize::try_from(len).map_err(|_| bad("field too long"))?;
                if buf.len() < len {
                    return Err(bad("truncated field"));
                }
                let (v, rest) = buf.split_at(len);
                buf = rest;
                v
            }
            WireType::StartGroup | WireType::EndGroup => return Err(bad("groups are not used")),
        };
        let raw = &start[..start.len() - buf.len()];
        out.push(Field {
            number,
            wire,
            payload,
            raw,
        });
    }
    Ok(out)
}

fn varint_of(f: &Field<'_>) -> Option<u64> {
    let mut p = f.payload;
    (f.wire == WireType::Varint)
        .then(|| decode_varint(&mut p).ok())
        .flatten()
}

/// Every value of a repeated `int64` field `number` of `fs` (packed or not).
fn repeated_i64(fs: &[Field<'_>], number: u32) -> Vec<i64> {
    let mut out = Vec::new();
    for f in fs.iter().filter(|f| f.number == number) {
        match f.wire {
            WireType::Varint => out.extend(varint_of(f).map(|v| v as i64)),
            WireType::LengthDelimited => {
                let mut p = f.payload;
                while let Ok(v) = decode_varint(&mut p) {
                    out.push(v as i64);
                    if p.is_empty() {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The last value of the singular field `number` (protobuf: the last occurrence wins).
fn last<'a, 'f>(fs: &'f [Field<'a>], number: u32) -> Option<&'f Field<'a>> {
    fs.iter().rev().find(|f| f.number == number)
}

fn string_field<'a>(fs: &[Field<'a>], number: u32) -> &'a [u8] {
    last(fs, number).map_or(&[][..], |f| f.payload)
}

fn put_bytes(out: &mut Vec<u8>, number: u32, bytes: &[u8]) {
    encode_key(number, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

fn put_varint(out: &mut Vec<u8>, number: u32, v: u64) {
    encode_key(number, WireType::Varint, out);
    encode_varint(v, out);
}

/// What the rewrite needs of one instruction.
struct Instr<'a> {
    name: &'a [u8],
    opcode: &'a [u8],
    id: i64,
    called: Vec<i64>,
    target: &'a [u8],
    backend_config: &'a [u8],
    shape: Option<&'a [u8]>,
}

fn instr<'a>(bytes: &'a [u8]) -> Result<Instr<'a>> {
    let fs = fields(bytes)?;
    Ok(Instr {
        name: string_field(&fs, 1),
        opcode: string_field(&fs, 2),
        id: last(&fs, 35).and_then(varint_of).unwrap_or(0) as i64,
        called: repeated_i64(&fs, 38),
        target: string_field(&fs, 28),
        backend_config: string_field(&fs, 43),
        shape: last(&fs, 3).map(|f| f.payload),
    })
}

/// Result of [`budget_loops`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetedProgram {
    /// The rewritten `HloModuleProto`, to compile as format `"hlo"`.
    pub module: Vec<u8>,
    /// Names of the loops that were given a budget, in module order.
    pub loops: Vec<String>,
}

/// Which `while` loops of a module [`budget_loops`] budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopSelection<'a> {
    /// Those without a `known_trip_count` in their backend config (in an optimized program:
    /// the loops XLA could not bound).
    Unbounded,
    /// Those with one of these instruction names.
    Named(&'a [String]),
    /// Every loop.
    All,
}

/// Gives every `while` loop of the program `code` (a serialized `HloModuleProto`, format
/// `"hlo"`, or `"hlo_with_config"` as [`crate::LoadedExecutable::optimized_program`] returns
/// it) that `select` picks a call to the [`LOOP_BUDGET_TARGET`] custom call in its condition,
/// with `budget` as its attributes (see the module docs). `None` when it picks no loop.
///
/// The host gives it the module XLA dumps before its HLO passes
/// ([`crate::CompileOptions::dump_hlo_to`]) with the names of the loops the optimized program
/// could not bound: an optimized module does not compile again on the CPU plugins (its
/// fusions abort XLA's CPU emitter), the module before the passes does.
///
/// Errors: `PermissionDenied` when the program already calls [`LOOP_BUDGET_TARGET`] (only
/// this rewrite may); `Internal` when the bytes do not decode as a module or a loop's
/// condition cannot be found; `Unimplemented` for another format.
pub fn budget_loops(
    format: &str,
    code: &[u8],
    budget: LoopBudget,
    select: LoopSelection<'_>,
) -> Result<Option<BudgetedProgram>> {
    let module = crate::hlo::module_bytes(format, code)?;
    let top = fields(&module)?;
    // Pass 1: unbounded loops, their conditions, the largest id.
    let mut conditions: Vec<i64> = Vec::new();
    let mut loops = Vec::new();
    for c in top.iter().filter(|f| f.number == 3) {
        let cf = fields(c.payload)?;
        for i in cf.iter().filter(|f| f.number == 2) {
            let ins = instr(i.payload)?;
            if ins.opcode == b"custom-call" && ins.target == LOOP_BUDGET_TARGET.as_bytes() {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    format!("the program calls {LOOP_BUDGET_TARGET}, which only the host may"),
                ));
            }
            let picked = match select {
                LoopSelection::Unbounded => {
                    crate::hlo::known_trip_count(ins.backend_config).is_none()
                }
                LoopSelection::Named(names) => names.iter().any(|n| n.as_bytes() == ins.name),
                LoopSelection::All => true,
            };
            if ins.opcode == b"while" && picked {
                let cond = *ins
                    .called
                    .get(1)
                    .ok_or_else(|| bad("a while loop without a condition"))?;
                if !conditions.contains(&cond) {
                    conditions.push(cond);
                }
                loops.push(String::from_utf8_lossy(ins.name).into_owned());
            }
        }
    }
    if loops.is_empty() {
        return Ok(None);
    }
    let config = format!(
        "{{iterations = {} : i64, work = {} : i64, step = {} : i64}}",
        i64::try_from(budget.iterations).unwrap_or(i64::MAX),
        i64::try_from(budget.work).unwrap_or(i64::MAX),
        i64::try_from(budget.step.max(1)).unwrap_or(i64::MAX),
    );
    // Pass 2: copy the module, rewriting the condition computations.
    let mut out = Vec::with_capacity(module.len() + 256 * conditions.len());
    let mut done = 0usize;
    for f in &top {
        match f.number {
            7 => {} // schedule: dropped (module docs)
            3 => {
                let cf = fields(f.payload)?;
                let id = last(&cf, 5).and_then(varint_of).unwrap_or(0) as i64;
                if !conditions.contains(&id) {
                    out.extend_from_slice(f.raw);
                    continue;
                }
                let root_id = last(&cf, 6)
                    .and_then(varint_of)
                    .ok_or_else(|| bad("a loop condition without a root"))?
                    as i64;
                let root_shape = cf
                    .iter()
                    .filter(|f| f.number == 2)
                    .map(|i| instr(i.payload))
                    .collect::<Result<Vec<_>>>()?
                    .into_iter()
                    .find(|i| i.id == root_id)
                    .and_then(|i| i.shape)
                    .ok_or_else(|| bad("a loop condition's root has no shape"))?
                    .to_vec();
                // XLA keys instructions by the low 32 bits of their ids within a computation
                // (the high bits may hold the computation's id): fresh low bits above every
                // instruction of this computation, the root's high bits.
                let local = cf
                    .iter()
                    .filter(|f| f.number == 2)
                    .map(|i| instr(i.payload).map(|i| i.id & LOCAL_ID))
                    .collect::<Result<Vec<_>>>()?
                    .into_iter()
                    .max()
                    .unwrap_or(0);
                if local + 2 > LOCAL_ID {
                    return Err(bad("no instruction ids left in a loop condition"));
                }
                let high = root_id & !LOCAL_ID;
                let call_id = high | (local + 1);
                let and_id = high | (local + 2);
                done += 1;
                let mut call = Vec::new();
                put_bytes(
                    &mut call,
                    1,
                    format!("tpubox_loop_budget.{done}").as_bytes(),
                );
                put_bytes(&mut call, 2, b"custom-call");
                put_bytes(&mut call, 3, &root_shape);
                put_bytes(&mut call, 28, LOOP_BUDGET_TARGET.as_bytes());
                put_varint(&mut call, 35, call_id as u64);
                put_bytes(&mut call, 43, config.as_bytes());
                put_varint(&mut call, 65, 1);
                put_varint(&mut call, 77, 4);
                let mut and = Vec::new();
                put_bytes(
                    &mut and,
                    1,
                    format!("tpubox_loop_budget_and.{done}").as_bytes(),
                );
                put_bytes(&mut and, 2, b"and");
                put_bytes(&mut and, 3, &root_shape);
                put_varint(&mut and, 35, and_id as u64);
                put_varint(&mut and, 36, root_id as u64);
                put_varint(&mut and, 36, call_id as u64);
                let mut comp = f.payload.to_vec();
                put_bytes(&mut comp, 2, &call);
                put_bytes(&mut comp, 2, &and);
                put_varint(&mut comp, 6, and_id as u64);
                put_bytes(&mut out, 3, &comp);
            }
            _ => out.extend_from_slice(f.raw),
        }
    }
    if done != conditions.len() {
        return Err(bad("a loop's condition computation is not in the module"));
    }
    Ok(Some(BudgetedProgram { module: out, loops }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instruction(name: &str, opcode: &str, id: i64, called: &[i64], config: &str) -> Vec<u8> {
        let mut b = Vec::new();
        put_bytes(&mut b, 1, name.as_bytes());
        put_bytes(&mut b, 2, opcode.as_bytes());
        put_bytes(&mut b, 3, &[0x10, 0x01]); // ShapeProto { element_type: PRED }
        put_varint(&mut b, 35, id as u64);
        for c in called {
            put_varint(&mut b, 38, *c as u64);
        }
        put_bytes(&mut b, 43, config.as_bytes());
        b
    }

    fn computation(id: i64, root: i64, instrs: &[Vec<u8>]) -> Vec<u8> {
        let mut b = Vec::new();
        for i in instrs {
            put_bytes(&mut b, 2, i);
        }
        put_varint(&mut b, 5, id as u64);
        put_varint(&mut b, 6, root as u64);
        b
    }

    const BUDGET: LoopBudget = LoopBudget {
        iterations: 100,
        work: 1000,
        step: 7,
    };

    #[test]
    fn budgets_only_unbounded_loops() {
        let mut m = Vec::new();
        put_bytes(&mut m, 1, b"module");
        put_bytes(
            &mut m,
            3,
            &computation(1, 10, &[instruction("c", "compare", 10, &[], "")]),
        );
        put_bytes(
            &mut m,
            3,
            &computation(2, 20, &[instruction("k", "compare", 20, &[], "")]),
        );
        put_bytes(
            &mut m,
            3,
            &computation(
                3,
                31,
                &[
                    instruction("w", "while", 30, &[9, 1], ""),
                    instruction(
                        "b",
                        "while",
                        31,
                        &[9, 2],
                        r#"{"known_trip_count":{"n":"4"}}"#,
                    ),
                ],
            ),
        );
        put_bytes(&mut m, 7, b"\x0a\x00"); // a schedule, dropped
        let r = budget_loops("hlo", &m, BUDGET, LoopSelection::Unbounded)
            .unwrap()
            .unwrap();
        assert_eq!(r.loops, vec!["w".to_string()]);
        let top = fields(&r.module).unwrap();
        assert!(top.iter().all(|f| f.number != 7));
        let comps: Vec<_> = top.iter().filter(|f| f.number == 3).collect();
        assert_eq!(comps[1].raw, {
            let mut x = Vec::new();
            put_bytes(
                &mut x,
                3,
                &computation(2, 20, &[instruction("k", "compare", 20, &[], "")]),
            );
            x
        });
        let cf = fields(comps[0].payload).unwrap();
        let ins: Vec<_> = cf
            .iter()
            .filter(|f| f.number == 2)
            .map(|f| instr(f.payload).unwrap())
            .collect();
        assert_eq!(ins.len(), 3);
        assert_eq!(ins[1].target, LOOP_BUDGET_TARGET.as_bytes());
        assert_eq!(ins[1].id, 11);
        assert_eq!(
            ins[1].backend_config,
            b"{iterations = 100 : i64, work = 1000 : i64, step = 7 : i64}"
        );
        assert_eq!(ins[2].opcode, b"and");
        assert_eq!(ins[2].id, 12);
        assert_eq!(last(&cf, 6).and_then(varint_of), Some(12));
        let and_fields = fields(cf.iter().filter(|f| f.number == 2).nth(2).unwrap().payload);
        assert_eq!(repeated_i64(&and_fields.unwrap(), 36), vec![10, 11]);
    }

    #[test]
    fn no_unbounded_loop_no_rewrite_and_no_forged_budget() {
        let mut m = Vec::new();
        put_bytes(
            &mut m,
            3,
            &computation(1, 10, &[instruction("c", "compare", 10, &[], "")]),
        );
        assert_eq!(
            budget_loops("hlo", &m, BUDGET, LoopSelection::Unbounded).unwrap(),
            None
        );
        let mut forged = instruction("x", "custom-call", 11, &[], "");
        put_bytes(&mut forged, 28, LOOP_BUDGET_TARGET.as_bytes());
        put_bytes(&mut m, 3, &computation(2, 11, &[forged]));
        assert_eq!(
            budget_loops("hlo", &m, BUDGET, LoopSelection::Unbounded)
                .unwrap_err()
                .code,
            ErrorCode::PermissionDenied
        );
        assert!(budget_loops("hlo", b"\xff", BUDGET, LoopSelection::Unbounded).is_err());
    }
}
