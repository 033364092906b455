//! What a program's module declares about the devices it runs on (`mhlo.num_partitions`,
//! `mhlo.num_replicas`), read from MLIR text or from MLIR bytecode (portable VHLO as
//! `jax.export` writes it) without parsing the IR. Used by every door that compiles
//! ([`crate::session::Session::compile_with`] checks the count against the devices) and by
//! `tpubox exec` ([`crate::exec`]), which picks the devices from it.

/// The magic number MLIR bytecode starts with.
pub const BYTECODE_MAGIC: &[u8] = bytecode::MAGIC;

/// What a module declares about the devices it runs on (its `mhlo.num_partitions` and
/// `mhlo.num_replicas` attributes; `None` where it has none, which XLA reads as 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeclaredDevices {
    /// `mhlo.num_partitions`.
    pub partitions: Option<u64>,
    /// `mhlo.num_replicas`.
    pub replicas: Option<u64>,
}

impl DeclaredDevices {
    /// The number of partitions (1 when the module declares none).
    pub fn partitions(&self) -> u64 {
        self.partitions.unwrap_or(1)
    }

    /// The number of replicas (1 when the module declares none).
    pub fn replicas(&self) -> u64 {
        self.replicas.unwrap_or(1)
    }
}

/// The module attribute holding the partition count.
pub(crate) const NUM_PARTITIONS: &str = "mhlo.num_partitions";
/// The module attribute holding the replica count.
pub(crate) const NUM_REPLICAS: &str = "mhlo.num_replicas";

/// Reads the device counts a module declares, from MLIR text (`mhlo.num_partitions = 4 :
/// i32` among the module's attributes) or MLIR bytecode (portable VHLO as `jax.export`
/// writes it, or any other MLIR bytecode whose module attributes are builtin integers).
///
/// Errors: a message when the bytecode is malformed, or names an attribute whose value is not
/// a builtin integer; or when the module gives one attribute two different values.
pub fn declared_devices(code: &[u8]) -> std::result::Result<DeclaredDevices, String> {
    if code.starts_with(bytecode::MAGIC) {
        let found = bytecode::module_integers(code, &[NUM_PARTITIONS, NUM_REPLICAS])?;
        return Ok(DeclaredDevices {
            partitions: found[0],
            replicas: found[1],
        });
    }
    let text = std::str::from_utf8(code).map_err(|_| "MLIR text is not valid UTF-8".to_string())?;
    Ok(DeclaredDevices {
        partitions: text_integer(text, NUM_PARTITIONS)?,
        replicas: text_integer(text, NUM_REPLICAS)?,
    })
}

/// The value of `name = N` in MLIR text (every occurrence followed by `= digits` must agree).
fn text_integer(text: &str, name: &str) -> std::result::Result<Option<u64>, String> {
    let mut found: Option<u64> = None;
    for (at, _) in text.match_indices(name) {
        let rest = text[at + name.len()..].trim_start();
        let Some(rest) = rest.strip_prefix('=') else {
            continue;
        };
        let rest = rest.trim_start();
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let Ok(v) = rest[..digits].parse::<u64>() else {
            continue;
        };
        match found {
            Some(f) if f != v => return Err(format!("the module gives {name} both {f} and {v}")),
            _ => found = Some(v),
        }
    }
    Ok(found)
}

/// Just enough of MLIR's bytecode format (mlir.llvm.org/docs/BytecodeFormat, versions 0–6) to
/// read builtin integer attributes out of the module's attribute dictionary: the string
/// section, the dialect names, the attribute and type tables and the builtin dialect's
/// encodings of `StringAttr`, `DictionaryAttr`, `IntegerAttr` and `IntegerType`. The IR
/// section is not read. Every read is bounds-checked: a malformed file is an `Err`, never a
/// panic.
mod bytecode {
    pub(super) const MAGIC: &[u8] = b"ML\xefR";

    // Section ids.
    const STRING: u8 = 0;
    const DIALECT: u8 = 1;
    const ATTR_TYPE: u8 = 2;
    const ATTR_TYPE_OFFSET: u8 = 3;
    const SECTIONS: usize = 9;
    /// Bytecode version that added dialect versions (and the flag on dialect names).
    const DIALECT_VERSIONING: u64 = 1;

    // Builtin dialect codes (BuiltinDialectBytecode.td).
    const DICTIONARY_ATTR: u64 = 1;
    const STRING_ATTR: u64 = 2;
    const INTEGER_ATTR: u64 = 8;
    const INTEGER_TYPE: u64 = 0;

    type R<T> = Result<T, String>;

    struct Reader<'a> {
        data: &'a [u8],
        pos: usize,
        /// Offset of `data` in the file (alignment is relative to the file's start).
        base: usize,
    }

    impl<'a> Reader<'a> {
        fn new(data: &'a [u8], base: usize) -> Self {
            Reader { data, pos: 0, base }
        }

        fn is_empty(&self) -> bool {
            self.pos >= self.data.len()
        }

        fn byte(&mut self) -> R<u8> {
            let b = *self.data.get(self.pos).ok_or("truncated bytecode")?;
            self.pos += 1;
            Ok(b)
        }

        fn take(&mut self, n: u64) -> R<&'a [u8]> {
            let n = usize::try_from(n).map_err(|_| "a length overflows")?;
            let end = self
                .pos
                .checked_add(n)
                .filter(|&e| e <= self.data.len())
                .ok_or("truncated bytecode")?;
            let s = &self.data[self.pos..end];
            self.pos = end;
            Ok(s)
        }

        /// A prefix varint: the first byte's trailing zeros count the bytes that follow.
        fn varint(&mut self) -> R<u64> {
            let first = self.byte()?;
            if first & 1 == 1 {
                return Ok(u64::from(first >> 1));
            }
            if first == 0 {
                let b = self.take(8)?;
                return Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")));
            }
            let extra = first.trailing_zeros() as usize;
            let mut buf = [0u8; 8];
            buf[0] = first;
            buf[1..=extra].copy_from_slice(self.take(extra as u64)?);
            Ok(u64::from_le_bytes(buf) >> (extra + 1))
        }

        /// A varint whose low bit is a flag.
        fn varint_flag(&mut self) -> R<(u64, bool)> {
            let v = self.varint()?;
            Ok((v >> 1, v & 1 == 1))
        }

        /// A zigzag-encoded signed varint.
        fn signed_varint(&mut self) -> R<i64> {
            let v = self.varint()?;
            Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
        }

        /// A section: id byte (high bit: aligned), length, alignment and padding, data.
        fn section(&mut self) -> R<(u8, Reader<'a>)> {
            let id_and_aligned = self.byte()?;
            let len = self.varint()?;
            if id_and_aligned & 0x80 != 0 {
                let align = self.varint()?;
                if !align.is_power_of_two() || align > 4096 {
                    return Err(format!("a section alignment of {align}"));
                }
                while !((self.base + self.pos) as u64).is_multiple_of(align) {
                    if self.byte()? != 0xcb {
                        return Err("bad section padding".into());
                    }
                }
            }
            let base = self.base + self.pos;
            Ok((id_and_aligned & 0x7f, Reader::new(self.take(len)?, base)))
        }
    }

    /// One entry of the attribute or type table.
    struct Entry<'a> {
        dialect: usize,
        custom: bool,
        data: &'a [u8],
    }

    fn entries<'a>(
        offsets: &mut Reader<'a>,
        table: &'a [u8],
        count: u64,
        cursor: &mut usize,
        dialects: usize,
    ) -> R<Vec<Entry<'a>>> {
        let mut out = Vec::new();
        while (out.len() as u64) < count {
            let dialect = offsets.varint()?;
            if dialect >= dialects as u64 {
                return Err(format!("dialect {dialect} of {dialects}"));
            }
            let n = offsets.varint()?;
            for _ in 0..n {
                if out.len() as u64 >= count {
                    return Err("more table entries than declared".into());
                }
                let (size, custom) = offsets.varint_flag()?;
                let end = usize::try_from(size)
                    .ok()
                    .and_then(|s| cursor.checked_add(s))
                    .filter(|&e| e <= table.len())
                    .ok_or("a table entry runs past its section")?;
                out.push(Entry {
                    dialect: dialect as usize,
                    custom,
                    data: &table[*cursor..end],
                });
                *cursor = end;
            }
        }
        Ok(out)
    }

    /// The builtin dialect's code of a custom-encoded entry, and a reader after it.
    fn builtin_code<'a>(e: &Entry<'a>, builtin: usize) -> R<Option<(u64, Reader<'a>)>> {
        if e.dialect != builtin || !e.custom {
            return Ok(None);
        }
        let mut r = Reader::new(e.data, 0);
        Ok(Some((r.varint()?, r)))
    }

    /// For each of `names`, the value of the builtin integer attribute of that name in the
    /// module's attribute dictionaries (`None` where no dictionary holds it).
    pub(super) fn module_integers<'a>(code: &'a [u8], names: &[&str]) -> R<Vec<Option<u64>>> {
        let mut r = Reader::new(code, 0);
        if r.take(MAGIC.len() as u64)? != MAGIC {
            return Err("not MLIR bytecode".into());
        }
        let version = r.varint()?;
        while r.byte()? != 0 {} // the producer, NUL-terminated
        let mut sections: [Option<Reader>; SECTIONS] = Default::default();
        while !r.is_empty() {
            let (id, s) = r.section()?;
            let slot = sections
                .get_mut(id as usize)
                .ok_or_else(|| format!("unknown section {id}"))?;
            if slot.is_some() {
                return Err(format!("section {id} twice"));
            }
            *slot = Some(s);
        }
        let mut take = |id: u8| {
            sections[id as usize]
                .take()
                .ok_or_else(|| format!("no section {id}"))
        };
        let (mut strings_r, mut dialect_r) = (take(STRING)?, take(DIALECT)?);
        let (table, mut offsets) = (take(ATTR_TYPE)?, take(ATTR_TYPE_OFFSET)?);

        // Strings: their count, their sizes in reverse order, then the NUL-terminated strings
        // laid out from the section's end.
        let n = strings_r.varint()?;
        let mut end = strings_r.data.len();
        let mut strings: Vec<&[u8]> = Vec::new();
        for _ in 0..n {
            let size = usize::try_from(strings_r.varint()?).map_err(|_| "a string overflows")?;
            if size == 0 || size > end.saturating_sub(strings_r.pos) {
                return Err("a string runs past its section".into());
            }
            strings.push(&strings_r.data[end - size..end - 1]);
            end -= size;
        }
        strings.reverse();
        let string = |i: u64| -> R<&[u8]> {
            usize::try_from(i)
                .ok()
                .and_then(|i| strings.get(i).copied())
                .ok_or_else(|| format!("string {i} of {}", strings.len()))
        };

        // Dialect names (the op names that follow are not needed).
        let count = dialect_r.varint()?;
        let mut dialects: Vec<&[u8]> = Vec::new();
        for _ in 0..count {
            let index = if version < DIALECT_VERSIONING {
                dialect_r.varint()?
            } else {
                let (index, versioned) = dialect_r.varint_flag()?;
                if versioned {
                    dialect_r.section()?;
                }
                index
            };
            dialects.push(string(index)?);
        }
        let Some(builtin) = dialects.iter().position(|d| *d == b"builtin") else {
            return Ok(vec![None; names.len()]);
        };

        let attrs_n = offsets.varint()?;
        let types_n = offsets.varint()?;
        let mut cursor = 0;
        let attrs = entries(
            &mut offsets,
            table.data,
            attrs_n,
            &mut cursor,
            dialects.len(),
        )?;
        let types = entries(
            &mut offsets,
            table.data,
            types_n,
            &mut cursor,
            dialects.len(),
        )?;
        let builtin_entry = |e: &Entry<'a>| builtin_code(e, builtin);

        // The attribute indices of the StringAttrs naming each wanted key.
        let mut keys: Vec<Vec<u64>> = vec![Vec::new(); names.len()];
        for (i, e) in attrs.iter().enumerate() {
            if let Some((STRING_ATTR, mut r)) = builtin_entry(e)? {
                let s = string(r.varint()?)?;
                if let Some(k) = names.iter().position(|n| n.as_bytes() == s) {
                    keys[k].push(i as u64);
                }
            }
        }
        let mut found: Vec<Option<u64>> = vec![None; names.len()];
        if keys.iter().all(Vec::is_empty) {
            return Ok(found);
        }
        let integer = |index: u64| -> R<u64> {
            let e = usize::try_from(index)
                .ok()
                .and_then(|i| attrs.get(i))
                .ok_or_else(|| format!("attribute {index} of {}", attrs.len()))?;
            let Some((INTEGER_ATTR, mut r)) = builtin_entry(e)? else {
                return Err("its value is not a builtin integer".into());
            };
            let ty = r.varint()?;
            let te = usize::try_from(ty)
                .ok()
                .and_then(|i| types.get(i))
                .ok_or_else(|| format!("type {ty} of {}", types.len()))?;
            let Some((INTEGER_TYPE, mut tr)) = builtin_entry(te)? else {
                return Err("its type is not a builtin integer type".into());
            };
            let width = tr.varint()? >> 2;
            let v = match width {
                0 => return Err("an integer of width 0".into()),
                1..=8 => i64::from(r.byte()?),
                9..=64 => r.signed_varint()?,
                _ => return Err(format!("an integer of width {width}")),
            };
            u64::try_from(v).map_err(|_| format!("a negative count {v}"))
        };
        for (i, e) in attrs.iter().enumerate() {
            let Some((DICTIONARY_ATTR, mut r)) = builtin_entry(e)? else {
                continue;
            };
            let n = r.varint()?;
            for _ in 0..n {
                let (name, value) = (r.varint()?, r.varint()?);
                for (k, ids) in keys.iter().enumerate() {
                    if !ids.contains(&name) {
                        continue;
                    }
                    let v = integer(value)
                        .map_err(|e| format!("{} in dictionary {i}: {e}", names[k]))?;
                    match found[k] {
                        Some(f) if f != v => {
                            return Err(format!("{} is both {f} and {v}", names[k]));
                        }
                        _ => found[k] = Some(v),
                    }
                }
            }
        }
        for (k, ids) in keys.iter().enumerate() {
            if !ids.is_empty() && found[k].is_none() {
                return Err(format!("{} is named but its value was not found", names[k]));
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `jax.export`'s serialization (portable VHLO, StableHLO 1.15, bytecode version 6) of
    /// a 4-partition module: `mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32`,
    /// one `f32[8]` parameter split over the 4 devices, `add`.
    const GSPMD4_HEX: &str = concat!(
        "4d4cef520d537461626c65484c4f5f76312e31352e300001190501050901030b03070f13170343270901190b1b0b0f0b",
        "0f0b1313131313030f0f130b0b0b0b0b01030f0307131707028d050d03050507090b050f110111051111010505131701",
        "03031701050717010535170107151701090b03031b0d031d1f1d151d1723051d191d1b01020229032107110303030309",
        "044f0501510f030107043d0301050350110307042903050b03071300050615030305010107041703030603010501004e",
        "021d0f0b271d05252905150f110f0b116275696c74696e0076686c6f006d6f64756c650066756e635f7631006164645f",
        "76310072657475726e5f7631002d006d686c6f2e6e756d5f706172746974696f6e73006d686c6f2e6e756d5f7265706c",
        "69636173006d006d686c6f2e7368617264696e67007b646576696365733d5b345d3c3d5b345d7d006d61696e00707562",
        "6c696300081505051b010b1921192325",
    );

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn bytecode_counts_are_read() {
        let code = unhex(GSPMD4_HEX);
        assert_eq!(
            declared_devices(&code).unwrap(),
            DeclaredDevices {
                partitions: Some(4),
                replicas: Some(1)
            }
        );
    }

    #[test]
    fn every_truncation_and_corruption_is_handled() {
        let code = unhex(GSPMD4_HEX);
        for n in 0..code.len() {
            let _ = declared_devices(&code[..n]);
        }
        for i in 4..code.len() {
            for b in [0x00, 0x01, 0x02, 0x7f, 0x80, 0xcb, 0xfe, 0xff] {
                let mut c = code.clone();
                c[i] = b;
                let _ = declared_devices(&c);
            }
        }
    }

    #[test]
    fn text_counts_are_read() {
        let t =
            "module @m attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {}";
        assert_eq!(
            declared_devices(t.as_bytes()).unwrap(),
            DeclaredDevices {
                partitions: Some(4),
                replicas: Some(1)
            }
        );
        assert_eq!(
            declared_devices(b"module {}").unwrap(),
            DeclaredDevices::default()
        );
        let two =
            "module attributes {mhlo.num_partitions = 4 : i32} { // mhlo.num_partitions = 2\n}";
        assert!(declared_devices(two.as_bytes()).is_err());
    }

    #[test]
    fn malformed_bytecode_is_an_error_not_a_panic() {
        // Truncations of a header and of a varint that claims 8 more bytes.
        for bytes in [
            &b"ML\xefR"[..],
            b"ML\xefR\x0d",
            b"ML\xefR\x0dStableHLO\0\x00",
            b"ML\xefR\x0dx\0\x00\xff\xff",
            b"ML\xefR\x0dx\0\x81\x02",
            b"ML\xefR\x0dx\0\x00\x03\xff",
        ] {
            assert!(declared_devices(bytes).is_err(), "{bytes:?}");
        }
    }
}
