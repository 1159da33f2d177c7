//! Hostile policies a few lines away from a good one, as WAT text: what the sandbox's
//! tests and its benchmark (`benches/sandbox.rs`) run against the host.

/// The hand-written `passthrough` policy, the start of every variant.
pub const PASSTHROUGH_WAT: &str = include_str!("../../policies/wat/passthrough/passthrough.wat");

/// The hand-written `passthrough` policy with `from` replaced by `to` in its source: a
/// hostile variant a few lines away from a good policy.
pub fn passthrough_variant(from: &str, to: &str) -> String {
    let source = PASSTHROUGH_WAT;
    assert!(source.contains(from), "passthrough.wat has no `{from}`");
    source.replace(from, to)
}

/// `passthrough`, not batching (so a client's `malloc` reaches it), with its `malloc`
/// export replaced by `malloc`.
fn unbatched_with_malloc(malloc: &str) -> String {
    let batching = "(i32.store8 (i32.const 32) (i32.const 1))";
    let not_batching = "(i32.store8 (i32.const 32) (i32.const 0))";
    let passthrough_malloc =
        "(func (export \"allocbox:policy/allocator@0.1.0#malloc\") (param $size i64) (result i64)
    (call $count (call $up_malloc (local.get $size))))";
    let variant = passthrough_variant(batching, not_batching);
    assert!(
        variant.contains(passthrough_malloc),
        "passthrough.wat's malloc changed"
    );
    variant.replace(passthrough_malloc, malloc)
}

/// The `passthrough` policy with `tables` tables of `entries` funcref entries each.
pub fn with_tables(tables: usize, entries: u32) -> String {
    let declared: String = (0..tables)
        .map(|_| format!("(table {entries} funcref)\n"))
        .collect();
    passthrough_variant(
        "(memory (export \"memory\") 1)",
        &format!("(memory (export \"memory\") 1)\n{declared}"),
    )
}

/// `passthrough`, but its `malloc` grows its memory a MiB at a time and eight tables 64 Ki
/// entries at a time, touching every page and entry, until every growth fails; then it
/// traps. It does not batch, so a client's `malloc` reaches it.
pub fn memory_and_table_hog() -> String {
    let tables: String = (0..8)
        .map(|t| format!("(table $t{t} 0 funcref)\n"))
        .collect();
    let grow_tables: String = (0..8)
        .map(|t| {
            format!(
                "(local.set $at (table.grow $t{t} (ref.null func) (i32.const 65536)))
                 (if (i32.ne (local.get $at) (i32.const -1)) (then
                   (local.set $grew (i32.const 1))
                   (table.fill $t{t} (local.get $at) (ref.func $count) (i32.const 65536))))\n"
            )
        })
        .collect();
    unbatched_with_malloc(&format!(
        "{tables}
  (elem declare func $count)
  (func (export \"allocbox:policy/allocator@0.1.0#malloc\") (param $size i64) (result i64)
    (local $at i32) (local $grew i32)
    (loop $more
      (local.set $grew (i32.const 0))
      (local.set $at (memory.grow (i32.const 16)))
      (if (i32.ne (local.get $at) (i32.const -1)) (then
        (local.set $grew (i32.const 1))
        (memory.fill (i32.shl (local.get $at) (i32.const 16)) (i32.const 1) (i32.const 1048576))))
      {grow_tables}
      (br_if $more (local.get $grew)))
    unreachable)"
    ))
}

/// `passthrough`, not batching, whose `malloc` first takes 1-byte blocks from upstream
/// until it is refused, and keeps them (or, not `hoarding`, takes none).
pub fn one_byte_blocks(hoarding: bool) -> String {
    let take = match hoarding {
        true => "(br_if $hoard (i64.ne (call $up_malloc (i64.const 1)) (i64.const 0)))",
        false => "",
    };
    unbatched_with_malloc(&format!(
        "(func (export \"allocbox:policy/allocator@0.1.0#malloc\") (param $size i64) (result i64)
    (loop $hoard {take})
    (call $count (call $up_malloc (local.get $size))))"
    ))
}

/// `passthrough` with `functions` more empty functions: a policy that costs its compiler
/// about 5 KB and 25 µs a function.
pub fn with_functions(functions: usize) -> String {
    let extra = "(func)\n".repeat(functions);
    passthrough_variant(
        "(func (export \"allocbox:policy/lifecycle@0.1.0#trim\"))",
        &format!("(func (export \"allocbox:policy/lifecycle@0.1.0#trim\"))\n{extra}"),
    )
}
