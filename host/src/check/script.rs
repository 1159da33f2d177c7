//! The text form of a check case: client operations and scripts of them, one thread
//! per section, that `allocbox replay` reads back.

use std::fmt;

/// One client operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Malloc(u64),
    Calloc(u64, u64),
    /// Resize the block in the slot; `None` (or no live block) is realloc from null.
    Realloc(Option<usize>, u64),
    /// Free the block in the slot (nothing when no block is live).
    Free(usize),
    /// Ask every policy of the chain to give back what it caches; a policy must stay
    /// correct across it at any point of its life, not only once everything is freed.
    Trim,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Malloc(size) => write!(f, "malloc {size}"),
            Op::Calloc(n, e) => write!(f, "calloc {n} {e}"),
            Op::Realloc(None, size) => write!(f, "realloc - {size}"),
            Op::Realloc(Some(slot), size) => write!(f, "realloc #{slot} {size}"),
            Op::Free(slot) => write!(f, "free #{slot}"),
            Op::Trim => write!(f, "trim"),
        }
    }
}

impl std::str::FromStr for Op {
    type Err = String;

    fn from_str(line: &str) -> Result<Op, String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |w: &str| w.parse::<u64>().map_err(|e| format!("`{w}`: {e}"));
        let slot = |w: &str| {
            w.strip_prefix('#')
                .ok_or_else(|| format!("`{w}`: a block is written #N"))?
                .parse::<usize>()
                .map_err(|e| format!("`{w}`: {e}"))
        };
        match words.as_slice() {
            ["malloc", size] => Ok(Op::Malloc(num(size)?)),
            ["calloc", n, e] => Ok(Op::Calloc(num(n)?, num(e)?)),
            ["realloc", "-", size] => Ok(Op::Realloc(None, num(size)?)),
            ["realloc", s, size] => Ok(Op::Realloc(Some(slot(s)?), num(size)?)),
            ["free", s] => Ok(Op::Free(slot(s)?)),
            ["trim"] => Ok(Op::Trim),
            _ => Err(format!("not an operation: `{line}`")),
        }
    }
}

impl Op {
    /// The `field`th number of the operation (sizes, counts, slots), for shrinking.
    pub(super) fn number(&self, field: usize) -> Option<u64> {
        match (self, field) {
            (Op::Malloc(size), 0) | (Op::Realloc(None, size), 0) => Some(*size),
            (Op::Calloc(n, _), 0) => Some(*n),
            (Op::Calloc(_, e), 1) => Some(*e),
            (Op::Realloc(Some(slot), _), 0) | (Op::Free(slot), 0) => Some(*slot as u64),
            (Op::Realloc(Some(_), size), 1) => Some(*size),
            _ => None,
        }
    }

    pub(super) fn set_number(&mut self, field: usize, value: u64) {
        match (self, field) {
            (Op::Malloc(size), 0) | (Op::Realloc(None, size), 0) => *size = value,
            (Op::Calloc(n, _), 0) => *n = value,
            (Op::Calloc(_, e), 1) => *e = value,
            (Op::Realloc(Some(slot), _), 0) | (Op::Free(slot), 0) => *slot = value as usize,
            (Op::Realloc(Some(_), size), 1) => *size = value,
            _ => unreachable!("no number {field} in this operation"),
        }
    }
}

/// A replayable sequence: one list of operations per client thread, slots resolved.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Script {
    pub threads: Vec<Vec<Op>>,
}

impl Script {
    /// Number of operations in all threads.
    pub fn len(&self) -> usize {
        self.threads.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Parse the text form: one operation a line, `# ` comments, `thread` lines between
    /// the operations of different client threads.
    pub fn parse(text: &str) -> Result<Script, String> {
        let mut threads = vec![Vec::new()];
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line == "thread" {
                if !threads.last().is_some_and(Vec::is_empty) {
                    threads.push(Vec::new());
                }
                continue;
            }
            let op = line.parse().map_err(|e| format!("line {}: {e}", n + 1))?;
            threads.last_mut().expect("one thread at least").push(op);
        }
        Ok(Script { threads })
    }
}

impl fmt::Display for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, ops) in self.threads.iter().enumerate() {
            if i > 0 {
                writeln!(f, "thread")?;
            }
            for op in ops {
                writeln!(f, "{op}")?;
            }
        }
        Ok(())
    }
}
