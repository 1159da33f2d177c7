;; `counting-hook`: an event hook written by hand in WebAssembly text (the `hook` world).
;; It counts what it sees; `report` answers [new, free, renew, bytes newly allocated].
(module
  (memory (export "memory") 1)
  (global $new (mut i64) (i64.const 0))
  (global $free (mut i64) (i64.const 0))
  (global $renew (mut i64) (i64.const 0))
  (global $bytes (mut i64) (i64.const 0))

  (func (export "allocbox:policy/events@0.1.0#on-event") (param $old i64) (param $new i64) (param $size i64)
    (if (i64.eqz (local.get $old))
      (then
        (global.set $new (i64.add (global.get $new) (i64.const 1)))
        (global.set $bytes (i64.add (global.get $bytes) (local.get $size)))
        (return)))
    (if (i64.eqz (local.get $new))
      (then
        (global.set $free (i64.add (global.get $free) (i64.const 1)))
        (return)))
    (global.set $renew (i64.add (global.get $renew) (i64.const 1))))

  ;; list<u64>: (pointer, length) at 0, the four numbers at 16.
  (func (export "allocbox:policy/events@0.1.0#report") (result i32)
    (i64.store (i32.const 16) (global.get $new))
    (i64.store (i32.const 24) (global.get $free))
    (i64.store (i32.const 32) (global.get $renew))
    (i64.store (i32.const 40) (global.get $bytes))
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 4))
    (i32.const 0))
)
