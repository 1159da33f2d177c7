;; `sizes`: an event hook that keeps a histogram of request sizes by power of two, a
;; shipped hook (`allocbox --hook sizes`, `allocbox.set_event_hook("sizes")`).
;; `report` answers 64 numbers: number k counts the new and renew events whose size lies
;; in [2^k, 2^(k+1)) bytes (number 0 also counts requests of 0 bytes). Frees carry no
;; size and are not counted.
(module
  (memory (export "memory") 1)
  ;; The counts live at 64 + 8k; the list `report` returns is described at 0.

  (func (export "allocbox:policy/events@0.1.0#on-event") (param $old i64) (param $new i64) (param $size i64)
    (local $at i32)
    (if (i64.eqz (local.get $new)) (then (return)))
    ;; k = 63 - clz(size | 1), as a byte offset.
    (local.set $at
      (i32.add
        (i32.const 64)
        (i32.shl
          (i32.wrap_i64 (i64.sub (i64.const 63) (i64.clz (i64.or (local.get $size) (i64.const 1)))))
          (i32.const 3))))
    (i64.store (local.get $at) (i64.add (i64.load (local.get $at)) (i64.const 1))))

  ;; list<u64>: (pointer, length) at 0.
  (func (export "allocbox:policy/events@0.1.0#report") (result i32)
    (i32.store (i32.const 0) (i32.const 64))
    (i32.store (i32.const 4) (i32.const 64))
    (i32.const 0))
)
