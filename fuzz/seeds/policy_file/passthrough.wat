;; `passthrough`: a policy written by hand in WebAssembly text, no toolchain needed.
;;
;; It is a core module written to the canonical ABI of the `allocbox:policy/policy`
;; world; allocbox makes it a component when it is loaded (what `wasm-tools component
;; new` would do). Every call goes to the upstream unchanged; the module counts the blocks
;; it has lent so that the example shows where a policy keeps its own state.
;;
;; Memory map: 0..64 the `init` answer, 64..130 its strings, 1024 the `malloc-many`
;; answer with its addresses at 1536..2048 (64 at most), 4096.. a bump area for arguments the host passes in
;; (the config list, `free-many`'s list), reset after each call that used it.
(module
  (import "allocbox:policy/allocator@0.1.0" "malloc" (func $up_malloc (param i64) (result i64)))
  (import "allocbox:policy/allocator@0.1.0" "calloc" (func $up_calloc (param i64 i64) (result i64)))
  (import "allocbox:policy/allocator@0.1.0" "realloc" (func $up_realloc (param i64 i64 i64) (result i64)))
  (import "allocbox:policy/allocator@0.1.0" "free" (func $up_free (param i64 i64)))

  (memory (export "memory") 1)
  (data (i32.const 64) "passthrough")

  (global $live (mut i64) (i64.const 0))
  (global $bump (mut i32) (i32.const 4096))

  (func $count (param $addr i64) (result i64)
    (if (i64.ne (local.get $addr) (i64.const 0))
      (then (global.set $live (i64.add (global.get $live) (i64.const 1)))))
    (local.get $addr))

  (func (export "allocbox:policy/allocator@0.1.0#malloc") (param $size i64) (result i64)
    (call $count (call $up_malloc (local.get $size))))

  (func (export "allocbox:policy/allocator@0.1.0#calloc") (param $n i64) (param $e i64) (result i64)
    (call $count (call $up_calloc (local.get $n) (local.get $e))))

  (func (export "allocbox:policy/allocator@0.1.0#realloc")
        (param $ptr i64) (param $old i64) (param $new i64) (result i64)
    (local $moved i64)
    (local.set $moved (call $up_realloc (local.get $ptr) (local.get $old) (local.get $new)))
    ;; realloc from 0 is a new block; a moved block is still one block.
    (if (i64.eqz (local.get $ptr)) (then (drop (call $count (local.get $moved)))))
    (local.get $moved))

  (func $free (export "allocbox:policy/allocator@0.1.0#free") (param $ptr i64) (param $size i64)
    (global.set $live (i64.sub (global.get $live) (i64.const 1)))
    (call $up_free (local.get $ptr) (local.get $size)))

  ;; Up to 64 blocks per call; "fewer" is allowed by the contract.
  (func (export "allocbox:policy/allocator@0.1.0#malloc-many")
        (param $size i64) (param $count i32) (result i32)
    (local $i i32) (local $addr i64)
    (if (i32.gt_u (local.get $count) (i32.const 64)) (then (local.set $count (i32.const 64))))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $count)))
        (local.set $addr (call $count (call $up_malloc (local.get $size))))
        (br_if $done (i64.eqz (local.get $addr)))
        (i64.store (i32.add (i32.const 1536) (i32.shl (local.get $i) (i32.const 3))) (local.get $addr))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    ;; The answer: (pointer, length) of the list, kept at 1024.
    (i32.store (i32.const 1024) (i32.const 1536))
    (i32.store (i32.const 1028) (local.get $i))
    (i32.const 1024))

  (func (export "allocbox:policy/allocator@0.1.0#free-many")
        (param $list i32) (param $len i32) (param $size i64)
    (local $i i32)
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
        (call $free
          (i64.load (i32.add (local.get $list) (i32.shl (local.get $i) (i32.const 3))))
          (local.get $size))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (global.set $bump (i32.const 4096)))

  ;; result<info, string>: tag at 0, payload at 8. info = {name: (ptr, len) at 8,
  ;; version: u8 at 16, alignment: u64 at 24, batch: bool at 32}.
  (func (export "allocbox:policy/lifecycle@0.1.0#init") (param $cfg i32) (param $len i32) (result i32)
    (global.set $bump (i32.const 4096))
    (if (i32.ne (local.get $len) (i32.const 0))
      (then
        ;; Any key is unknown: err("passthrough takes no configuration").
        (i32.store8 (i32.const 0) (i32.const 1))
        (i32.store (i32.const 8) (i32.const 96))
        (i32.store (i32.const 12) (i32.const 34))
        (return (i32.const 0))))
    (i32.store8 (i32.const 0) (i32.const 0))
    (i32.store (i32.const 8) (i32.const 64))
    (i32.store (i32.const 12) (i32.const 11))
    (i32.store8 (i32.const 16) (i32.const 1))
    (i64.store (i32.const 24) (i64.const 16))
    (i32.store8 (i32.const 32) (i32.const 1))
    (i32.const 0))
  (data (i32.const 96) "passthrough takes no configuration")

  (func (export "allocbox:policy/lifecycle@0.1.0#trim"))

  ;; Allocation for arguments the host passes in: a bump from 4096, reset by the calls
  ;; that take lists once they are done with them.
  (func (export "cabi_realloc") (param $old i32) (param $old_size i32) (param $align i32) (param $size i32) (result i32)
    (local $at i32) (local $end i32)
    (local.set $at (i32.and
      (i32.add (global.get $bump) (i32.sub (local.get $align) (i32.const 1)))
      (i32.sub (i32.const 0) (local.get $align))))
    (local.set $end (i32.add (local.get $at) (local.get $size)))
    (if (i32.gt_u (local.get $end) (i32.shl (memory.size) (i32.const 16)))
      (then
        (if (i32.eq (memory.grow
              (i32.shr_u (i32.add (i32.sub (local.get $end) (i32.shl (memory.size) (i32.const 16))) (i32.const 65535)) (i32.const 16)))
              (i32.const -1))
          (then unreachable))))
    (if (local.get $old_size)
      (then (memory.copy (local.get $at) (local.get $old) (local.get $old_size))))
    (global.set $bump (local.get $end))
    (local.get $at))
)
