//! A pickle read as plain data, never as code: the opcodes of dicts, lists, tuples,
//! strings, bytes, numbers, booleans and None, and the memo that shares them. Any opcode
//! that would name a global or call one (what makes a pickle code) is refused with one
//! line, before anything of it is used. What a PyTorch memory snapshot is made of.
//!
//! Values live in one arena and refer to each other by index: a value the memo shares
//! is never copied, a deep or cyclic structure is never walked by recursion, and the
//! whole costs a bounded number of bytes per byte of input ([`budget`]). A dict's keys
//! are hashed, so a lookup costs the same in a dict of ten keys or of a million shared
//! through the memo by every entry: reading a snapshot is linear in its bytes.

use std::collections::HashMap;
use std::hash::BuildHasher;

/// A value of the pickle, by its index in [`Pickle::nodes`].
pub(super) type Id = usize;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Node {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(usize),
    List(Vec<Id>),
    Tuple(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    /// An integer past 64 bits: only its size is kept.
    BigInt,
}

/// A decoded pickle: every value, and the one it stopped with.
#[derive(Debug)]
pub(super) struct Pickle {
    pub(super) nodes: Vec<Node>,
    pub(super) root: Id,
    /// The string keys of every dict past [`INDEXED_AT`] items, by the dict and the
    /// key's hash.
    keys: HashMap<(Id, u64), Keyed, foldhash::fast::FixedState>,
}

/// A dict of more items than this has its keys hashed; a smaller one (a snapshot's
/// entries and frames have under ten) is searched.
const INDEXED_AT: usize = 16;

/// What an index holds of one hash of a dict's keys.
#[derive(Debug, Clone, Copy)]
enum Keyed {
    /// The key's node and its value (the last set, as Python keeps).
    One { key: Id, value: Id },
    /// Two different keys of one hash: searched.
    Collided,
}

/// What the index costs per key it holds, counted in the decode's budget.
const KEYED_BYTES: usize = 48;

impl Pickle {
    pub(super) fn node(&self, id: Id) -> &Node {
        &self.nodes[id]
    }

    fn key_hash(key: &str) -> u64 {
        foldhash::fast::FixedState::default().hash_one(key)
    }

    /// The keys of the dicts past [`INDEXED_AT`] items, to index.
    fn keys_to_index(nodes: &[Node]) -> usize {
        nodes
            .iter()
            .map(|node| match node {
                Node::Dict(items) if items.len() > INDEXED_AT => items.len(),
                _ => 0,
            })
            .sum()
    }

    /// Index the keys of every large dict.
    fn with_keys(nodes: Vec<Node>, root: Id) -> Pickle {
        let mut keys: HashMap<(Id, u64), Keyed, _> = HashMap::default();
        let same = |a: Id, b: Id| match (&nodes[a], &nodes[b]) {
            (Node::Str(a), Node::Str(b)) => a == b,
            _ => false,
        };
        for (id, node) in nodes.iter().enumerate() {
            let Node::Dict(items) = node else { continue };
            if items.len() <= INDEXED_AT {
                continue;
            }
            for &(key, value) in items {
                let Node::Str(text) = &nodes[key] else {
                    continue;
                };
                let slot = keys
                    .entry((id, Pickle::key_hash(text)))
                    .or_insert(Keyed::One { key, value });
                if let Keyed::One { key: known, .. } = *slot {
                    *slot = match same(known, key) {
                        true => Keyed::One { key, value },
                        false => Keyed::Collided,
                    };
                }
            }
        }
        Pickle { nodes, root, keys }
    }

    /// The value under `key` of the dict `id`, if it is a dict that has one (the last
    /// set, as Python keeps).
    pub(super) fn get(&self, id: Id, key: &str) -> Option<Id> {
        let Node::Dict(items) = self.node(id) else {
            return None;
        };
        let is_key = |k: Id| matches!(self.node(k), Node::Str(s) if s == key);
        let search = || {
            items
                .iter()
                .rev()
                .find(|&&(k, _)| is_key(k))
                .map(|&(_, v)| v)
        };
        if items.len() <= INDEXED_AT {
            return search();
        }
        match self.keys.get(&(id, Pickle::key_hash(key)))? {
            Keyed::One { key, value } => is_key(*key).then_some(*value),
            Keyed::Collided => search(),
        }
    }

    /// The items of the list or tuple `id`.
    pub(super) fn items(&self, id: Id) -> &[Id] {
        match self.node(id) {
            Node::List(items) | Node::Tuple(items) => items,
            _ => &[],
        }
    }

    pub(super) fn int(&self, id: Id) -> Option<i64> {
        match self.node(id) {
            Node::Int(n) => Some(*n),
            Node::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    pub(super) fn str(&self, id: Id) -> Option<&str> {
        match self.node(id) {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// What is on the machine's stack: a value, or a mark.
#[derive(Clone, Copy)]
enum Slot {
    Value(Id),
    Mark,
}

/// The most bytes a decode holds, whatever the bytes ask for: its values, stack,
/// memo, the items of its containers, its strings and the index of its dicts' keys,
/// counted by length (a vector growing may hold up to twice its length at a moment). A
/// snapshot of a long history (PyTorch's `max_entries`, 10^5 entries with their frames)
/// holds under half of it.
pub(super) const MAX_HELD_BYTES: usize = 256 << 20;

/// The most bytes a decode holds per byte of its input (a value is at least one byte
/// of it): with [`MAX_HELD_BYTES`], what [`budget`] allows.
pub(super) const HELD_PER_BYTE: usize = 24;

/// What decoding `len` bytes may hold: at most [`HELD_PER_BYTE`] times them (and a MiB),
/// at most [`MAX_HELD_BYTES`]; so the decode's peak is at most twice that, 48 times the
/// file and 512 MiB.
pub(super) fn budget(len: usize) -> usize {
    len.saturating_mul(HELD_PER_BYTE)
        .saturating_add(1 << 20)
        .min(MAX_HELD_BYTES)
}

/// What a memo entry costs in its map.
const MEMO_BYTES: usize = 24;

/// Decode `bytes` as a pickle of plain data; the error is one sentence.
pub(super) fn decode(bytes: &[u8]) -> Result<Pickle, String> {
    decode_within(bytes, budget(bytes.len()))
}

/// [`decode`], holding at most `most` bytes.
fn decode_within(bytes: &[u8], most: usize) -> Result<Pickle, String> {
    let mut nodes: Vec<Node> = Vec::new();
    let mut stack: Vec<Slot> = Vec::new();
    let mut memo: HashMap<u64, Id> = HashMap::new();
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| -> Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|&end| end <= bytes.len())
            .ok_or_else(|| {
                "the pickle ends part way through a value (is it cut short?)".to_string()
            })?;
        let taken = &bytes[*at..end];
        *at = end;
        Ok(taken)
    };
    let le = |b: &[u8]| {
        b.iter()
            .rev()
            .fold(0u64, |n, &byte| n << 8 | u64::from(byte))
    };
    fn push(nodes: &mut Vec<Node>, stack: &mut Vec<Slot>, node: Node) {
        nodes.push(node);
        stack.push(Slot::Value(nodes.len() - 1));
    }
    let pop = |stack: &mut Vec<Slot>| -> Result<Id, String> {
        match stack.pop() {
            Some(Slot::Value(id)) => Ok(id),
            _ => {
                Err("the pickle takes a value from an empty stack (is this file a pickle?)".into())
            }
        }
    };
    // The values above the topmost mark, which goes.
    let since_mark = |stack: &mut Vec<Slot>| -> Result<Vec<Id>, String> {
        let mark = stack
            .iter()
            .rposition(|slot| matches!(slot, Slot::Mark))
            .ok_or("the pickle closes a mark it never opened (is this file a pickle?)")?;
        let values = stack
            .drain(mark..)
            .skip(1)
            .map(|slot| match slot {
                Slot::Value(id) => id,
                Slot::Mark => unreachable!("the topmost mark"),
            })
            .collect();
        Ok(values)
    };
    // Items put in containers, and the bytes of strings: what values hold beside
    // themselves.
    let mut items_held = 0usize;
    let mut text_bytes = 0usize;
    let too_much = || {
        format!(
            "the pickle expands to more than {} MiB of values ({HELD_PER_BYTE} bytes for \
             each of its own, at most {} MiB), past what allocbox reads (record a shorter \
             history: `_record_memory_history(max_entries=...)`)",
            most >> 20,
            MAX_HELD_BYTES >> 20
        )
    };
    loop {
        let held = nodes.len() * size_of::<Node>()
            + stack.len() * size_of::<Slot>()
            + memo.len() * MEMO_BYTES
            + items_held * size_of::<Id>()
            + text_bytes;
        if held > most {
            return Err(too_much());
        }
        let op = *take(&mut at, 1)?.first().expect("one byte");
        match op {
            0x80 => {
                take(&mut at, 1)?; // PROTO
            }
            0x95 => {
                take(&mut at, 8)?; // FRAME: its length only helps a streaming reader
            }
            b'.' => {
                let root = pop(&mut stack)?;
                drop((stack, memo));
                if held + Pickle::keys_to_index(&nodes) * KEYED_BYTES > most {
                    return Err(too_much());
                }
                return Ok(Pickle::with_keys(nodes, root));
            }
            b'(' => stack.push(Slot::Mark),
            b'}' => push(&mut nodes, &mut stack, Node::Dict(Vec::new())),
            b']' => push(&mut nodes, &mut stack, Node::List(Vec::new())),
            b')' => push(&mut nodes, &mut stack, Node::Tuple(Vec::new())),
            b'N' => push(&mut nodes, &mut stack, Node::None),
            0x88 => push(&mut nodes, &mut stack, Node::Bool(true)),
            0x89 => push(&mut nodes, &mut stack, Node::Bool(false)),
            b'J' => {
                let n = i32::from_le_bytes(take(&mut at, 4)?.try_into().expect("4 bytes"));
                push(&mut nodes, &mut stack, Node::Int(i64::from(n)));
            }
            b'K' => {
                let n = take(&mut at, 1)?[0];
                push(&mut nodes, &mut stack, Node::Int(i64::from(n)));
            }
            b'M' => {
                let n = u16::from_le_bytes(take(&mut at, 2)?.try_into().expect("2 bytes"));
                push(&mut nodes, &mut stack, Node::Int(i64::from(n)));
            }
            0x8a | 0x8b => {
                let len = match op {
                    0x8a => le(take(&mut at, 1)?),
                    _ => le(take(&mut at, 4)?),
                };
                let digits = take(&mut at, usize::try_from(len).unwrap_or(usize::MAX))?;
                let node = match digits.len() {
                    0 => Node::Int(0),
                    1..=8 => {
                        // Two's complement, little-endian, sign-extended from its top byte.
                        let negative = digits.last().is_some_and(|&b| b & 0x80 != 0);
                        let mut word = [if negative { 0xff } else { 0 }; 8];
                        word[..digits.len()].copy_from_slice(digits);
                        Node::Int(i64::from_le_bytes(word))
                    }
                    _ => Node::BigInt,
                };
                push(&mut nodes, &mut stack, node);
            }
            b'G' => {
                let n = f64::from_be_bytes(take(&mut at, 8)?.try_into().expect("8 bytes"));
                push(&mut nodes, &mut stack, Node::Float(n));
            }
            0x8c | b'X' | 0x8d | b'C' | b'B' | 0x8e => {
                let len = match op {
                    0x8c | b'C' => le(take(&mut at, 1)?),
                    b'X' | b'B' => le(take(&mut at, 4)?),
                    _ => le(take(&mut at, 8)?),
                };
                let data = take(&mut at, usize::try_from(len).unwrap_or(usize::MAX))?;
                text_bytes += data.len();
                let node = match op {
                    0x8c | b'X' | 0x8d => Node::Str(
                        std::str::from_utf8(data)
                            .map_err(|_| "a string of the pickle is not UTF-8".to_string())?
                            .to_owned(),
                    ),
                    _ => Node::Bytes(data.len()),
                };
                push(&mut nodes, &mut stack, node);
            }
            0x94 | b'q' | b'r' => {
                let key = match op {
                    0x94 => memo.len() as u64,
                    b'q' => le(take(&mut at, 1)?),
                    _ => le(take(&mut at, 4)?),
                };
                match stack.last() {
                    Some(&Slot::Value(id)) => {
                        memo.insert(key, id);
                    }
                    _ => return Err("the pickle memoizes nothing".into()),
                }
            }
            b'h' | b'j' => {
                let key = match op {
                    b'h' => le(take(&mut at, 1)?),
                    _ => le(take(&mut at, 4)?),
                };
                let id = *memo
                    .get(&key)
                    .ok_or_else(|| format!("the pickle reuses value {key}, which it never kept"))?;
                stack.push(Slot::Value(id));
            }
            b'0' => {
                stack.pop();
            }
            b'1' => {
                since_mark(&mut stack)?;
            }
            b'2' => {
                let top = *stack
                    .last()
                    .ok_or("the pickle copies from an empty stack")?;
                stack.push(top);
            }
            b't' | 0x85 | 0x86 | 0x87 => {
                let items = match op {
                    b't' => since_mark(&mut stack)?,
                    _ => {
                        let n = usize::from(op - 0x84);
                        let mut items = (0..n)
                            .map(|_| pop(&mut stack))
                            .collect::<Result<Vec<_>, _>>()?;
                        items.reverse();
                        items
                    }
                };
                items_held += items.len();
                push(&mut nodes, &mut stack, Node::Tuple(items));
            }
            b'a' | b'e' => {
                let items = match op {
                    b'a' => vec![pop(&mut stack)?],
                    _ => since_mark(&mut stack)?,
                };
                let list = pop(&mut stack)?;
                items_held += items.len();
                match &mut nodes[list] {
                    Node::List(all) => all.extend(items),
                    _ => return Err("the pickle appends to a value that is no list".into()),
                }
                stack.push(Slot::Value(list));
            }
            b's' | b'u' => {
                let flat = match op {
                    b's' => {
                        let value = pop(&mut stack)?;
                        vec![pop(&mut stack)?, value]
                    }
                    _ => since_mark(&mut stack)?,
                };
                if flat.len() % 2 != 0 {
                    return Err("the pickle sets a key without a value".into());
                }
                let dict = pop(&mut stack)?;
                items_held += flat.len();
                match &mut nodes[dict] {
                    Node::Dict(all) => all.extend(flat.chunks(2).map(|pair| (pair[0], pair[1]))),
                    _ => return Err("the pickle sets an item of a value that is no dict".into()),
                }
                stack.push(Slot::Value(dict));
            }
            b'c' | 0x93 | b'R' | b'b' | b'i' | b'o' | 0x81 | 0x92 | 0x82 | 0x83 | 0x84 | b'P'
            | b'Q' => {
                return Err(format!(
                    "the pickle names code to run (opcode {op:#04x} at byte {}), which allocbox \
                     never does: a memory snapshot is plain data (dicts, lists, strings, numbers)",
                    at - 1
                ));
            }
            other => {
                return Err(format!(
                    "byte {} of the pickle is opcode {other:#04x}, which a plain-data pickle does \
                     not use (is this file a memory snapshot?)",
                    at - 1
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_data_decodes_with_shared_values_kept_once() {
        // pickle.dumps({"a": [1, -2, 300, 70000, 2**40, "x", None, True, 1.5]}, protocol=4)
        let bytes: &[u8] = &[
            0x80, 4, 0x95, 0x35, 0, 0, 0, 0, 0, 0, 0, b'}', 0x94, 0x8c, 1, b'a', 0x94, b']', 0x94,
            b'(', b'K', 1, b'J', 0xfe, 0xff, 0xff, 0xff, b'M', 0x2c, 1, b'J', 0x70, 0x11, 1, 0,
            0x8a, 6, 0, 0, 0, 0, 0, 1, 0x8c, 1, b'x', 0x94, b'N', 0x88, b'G', 0x3f, 0xf8, 0, 0, 0,
            0, 0, 0, b'e', b's', b'.',
        ];
        let pickle = decode(bytes).unwrap();
        let list = pickle.get(pickle.root, "a").unwrap();
        let values: Vec<&Node> = pickle
            .items(list)
            .iter()
            .map(|&id| pickle.node(id))
            .collect();
        assert_eq!(
            values,
            [
                &Node::Int(1),
                &Node::Int(-2),
                &Node::Int(300),
                &Node::Int(70000),
                &Node::Int(1 << 40),
                &Node::Str("x".into()),
                &Node::None,
                &Node::Bool(true),
                &Node::Float(1.5),
            ]
        );
    }

    /// Issue 62: a pickle is code. One that would call `os.system` is refused, and
    /// nothing of it runs: the decoder has no way to call anything.
    #[test]
    fn a_pickle_that_would_run_code_is_refused_in_one_line() {
        // pickle.dumps of an object whose __reduce__ is (os.system, ("echo pwned",)).
        let mut bytes = vec![0x80, 4];
        bytes.extend(b"\x8c\x05posix\x94\x8c\x06system\x94\x93\x94");
        bytes.extend(b"\x8c\x0aecho pwned\x94\x85\x94R\x94.");
        let error = decode(&bytes).unwrap_err();
        assert!(error.contains("names code to run"), "{error}");
        assert!(!error.contains('\n'), "{error}");
    }

    #[test]
    fn a_cut_or_malformed_pickle_is_refused_never_a_panic() {
        assert!(
            decode(&[0x80, 4, b']'])
                .unwrap_err()
                .contains("ends part way")
        );
        assert!(decode(b"a").unwrap_err().contains("empty stack"));
        assert!(decode(&[b'h', 3]).unwrap_err().contains("never kept"));
        // A claim of a string of 2^63 bytes is refused by what is there, not allocated.
        let huge = [0x8d, 0, 0, 0, 0, 0, 0, 0, 0x80];
        assert!(decode(&huge).unwrap_err().contains("ends part way"));
    }

    /// Issue 62: a snapshot's size bounds its bytes, not what they expand to: values
    /// shared through the memo and appended again and again are counted, and a pickle
    /// past the bound is refused in one line, having held no more.
    #[test]
    fn a_pickle_that_expands_past_the_bound_is_refused_having_held_no_more() {
        // A list, memoized, then the same list appended to itself 100 times.
        let mut bytes = vec![0x80, 4, b']', 0x94, b'('];
        bytes.extend(std::iter::repeat_n([b'h', 0], 100).flatten());
        bytes.extend(*b"e.");
        assert!(decode_within(&bytes, 4000).is_ok());
        let error = decode_within(&bytes, 800).unwrap_err();
        assert!(error.contains("expands to more than"), "{error}");
        // A stream of None: one value a byte.
        let mut nones = vec![0x80, 4];
        nones.extend(std::iter::repeat_n(b'N', 100));
        assert!(
            decode_within(&nones, 800)
                .unwrap_err()
                .contains("expands to more than")
        );
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }
    }
}
