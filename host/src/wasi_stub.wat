;; The `wasi_snapshot_preview1` a core-module policy sees: a sandbox with nothing in it.
;;
;; Toolchains for Go, C (wasi-libc), Zig or TinyGo link their runtime against WASI
;; preview 1 even when the program never prints or opens a file: the Go runtime reads the
;; clock and random bytes while it starts, and writes panics to stderr. allocbox applies
;; this module as the preview-1 adapter when it makes such a core module a component
;; (`componentize` in runtime.rs), in place of the standard adapter, which maps preview 1
;; onto real WASI 0.2 imports and calls back into the guest's allocator while the guest
;; is still starting.
;;
;; It imports the guest's own memory (`env.memory`, which wit-component wires to the main
;; module's exported memory) and the host's output buffer, so a policy gains no
;; capability from it: every answer is computed here, from the guest's own arguments,
;; and written only into the guest's own memory, at the addresses the guest passed.
;;
;; What each call does:
;; - clocks (every id 0..=3): a counter that advances 1 ns per read and never reads 0.
;;   It carries no real time, so the host's default (frozen clocks: a policy cannot time
;;   anything or leak timing into its placement) holds for core modules too, while
;;   runtimes that refuse a clock standing still (Go: "nanotime returning zero") start.
;; - `poll_oneoff`: a clock subscription completes at once and moves the counter past
;;   its timeout (virtual time), so a runtime that sleeps or waits on a timer does not
;;   spin until the call's time limit; a subscription on a descriptor fails with BADF.
;; - `random_get`: a fixed splitmix64 sequence from seed 0, the same in every instance,
;;   so a policy stays deterministic; it is not zeros, so a loop that waits for a
;;   non-zero draw ends.
;; - `fd_write` to 1 or 2: passes the bytes to the host (`allocbox:sandbox/output`), which
;;   keeps the last few KiB of what a policy printed for its errors (a Go panic message),
;;   as it does for a component's stdout and stderr.
;; - `args_*`, `environ_*`: nothing; `sched_yield`: done; `proc_exit`: a trap (a policy
;;   that exits has failed its caller).
;; - every other call takes a descriptor, and none is open: BADF (8). wasi-libc's start-up
;;   scans descriptors from 3 until BADF, so this answer, not NOSYS, lets C guests start.
;;   `proc_raise` is NOSYS (52).
;;
;; wit-component keeps only the functions the guest imports. An adapter may have no data
;; or element segments and no memory of its own; globals are allowed.
(module
  (import "env" "memory" (memory 0))
  (import "allocbox:sandbox/output@0.1.0" "write" (func $output (param i32 i32)))

  (global $now (mut i64) (i64.const 0))
  (global $seed (mut i64) (i64.const 0))

  ;; errno values
  ;; 0 SUCCESS, 8 BADF, 28 INVAL, 52 NOSYS

  (func (export "args_get") (param i32 i32) (result i32) (i32.const 0))
  (func (export "environ_get") (param i32 i32) (result i32) (i32.const 0))
  (func (export "args_sizes_get") (param $argc i32) (param $buf i32) (result i32)
    (i32.store (local.get $argc) (i32.const 0))
    (i32.store (local.get $buf) (i32.const 0))
    (i32.const 0))
  (func (export "environ_sizes_get") (param $count i32) (param $buf i32) (result i32)
    (i32.store (local.get $count) (i32.const 0))
    (i32.store (local.get $buf) (i32.const 0))
    (i32.const 0))

  (func (export "clock_res_get") (param $id i32) (param $out i32) (result i32)
    (if (i32.gt_u (local.get $id) (i32.const 3)) (then (return (i32.const 28))))
    (i64.store (local.get $out) (i64.const 1))
    (i32.const 0))
  (func (export "clock_time_get") (param $id i32) (param $precision i64) (param $out i32) (result i32)
    (if (i32.gt_u (local.get $id) (i32.const 3)) (then (return (i32.const 28))))
    (global.set $now (i64.add (global.get $now) (i64.const 1)))
    (i64.store (local.get $out) (global.get $now))
    (i32.const 0))

  ;; splitmix64: the next 8 bytes of the fixed sequence.
  (func $next (result i64)
    (local $z i64)
    (global.set $seed (i64.add (global.get $seed) (i64.const 0x9e3779b97f4a7c15)))
    (local.set $z (global.get $seed))
    (local.set $z (i64.mul (i64.xor (local.get $z) (i64.shr_u (local.get $z) (i64.const 30)))
                           (i64.const 0xbf58476d1ce4e5b9)))
    (local.set $z (i64.mul (i64.xor (local.get $z) (i64.shr_u (local.get $z) (i64.const 27)))
                           (i64.const 0x94d049bb133111eb)))
    (i64.xor (local.get $z) (i64.shr_u (local.get $z) (i64.const 31))))
  (func (export "random_get") (param $buf i32) (param $len i32) (result i32)
    (local $word i64) (local $i i32)
    (block $done
      (loop $words
        (br_if $done (i32.lt_u (local.get $len) (i32.const 8)))
        (i64.store (local.get $buf) (call $next))
        (local.set $buf (i32.add (local.get $buf) (i32.const 8)))
        (local.set $len (i32.sub (local.get $len) (i32.const 8)))
        (br $words)))
    (if (local.get $len)
      (then
        (local.set $word (call $next))
        (loop $tail
          (i32.store8 (local.get $buf) (i32.wrap_i64 (local.get $word)))
          (local.set $word (i64.shr_u (local.get $word) (i64.const 8)))
          (local.set $buf (i32.add (local.get $buf) (i32.const 1)))
          (local.set $len (i32.sub (local.get $len) (i32.const 1)))
          (br_if $tail (local.get $len)))))
    (i32.const 0))

  ;; iovecs are (buf: i32, len: i32) pairs; the answer is their total length.
  (func (export "fd_write") (param $fd i32) (param $iovs i32) (param $n i32) (param $written i32) (result i32)
    (local $total i32)
    (if (i32.and (i32.ne (local.get $fd) (i32.const 1)) (i32.ne (local.get $fd) (i32.const 2)))
      (then (return (i32.const 8))))
    (block $done
      (loop $each
        (br_if $done (i32.eqz (local.get $n)))
        (call $output (i32.load (local.get $iovs)) (i32.load offset=4 (local.get $iovs)))
        (local.set $total (i32.add (local.get $total) (i32.load offset=4 (local.get $iovs))))
        (local.set $iovs (i32.add (local.get $iovs) (i32.const 8)))
        (local.set $n (i32.sub (local.get $n) (i32.const 1)))
        (br $each)))
    (i32.store (local.get $written) (local.get $total))
    (i32.const 0))

  ;; subscription (48 bytes): userdata u64 @0, tag u8 @8; for a clock: timeout u64 @24,
  ;; flags u16 @40 (bit 0: absolute). event (32 bytes): userdata u64 @0, error u16 @8,
  ;; type u8 @10, fd_readwrite @16 (zeroed).
  (func (export "poll_oneoff") (param $in i32) (param $out i32) (param $n i32) (param $nevents i32) (result i32)
    (local $i i32) (local $tag i32) (local $timeout i64) (local $later i64)
    (if (i32.eqz (local.get $n)) (then (return (i32.const 28))))
    (loop $each
      (local.set $tag (i32.load8_u offset=8 (local.get $in)))
      (i64.store (local.get $out) (i64.load (local.get $in)))
      (i32.store16 offset=8 (local.get $out) (i32.const 0))
      (i32.store8 offset=10 (local.get $out) (local.get $tag))
      (i64.store offset=16 (local.get $out) (i64.const 0))
      (i64.store offset=24 (local.get $out) (i64.const 0))
      (if (i32.eqz (local.get $tag))
        (then
          (local.set $timeout (i64.load offset=24 (local.get $in)))
          (if (i32.and (i32.load16_u offset=40 (local.get $in)) (i32.const 1))
            (then (local.set $later (local.get $timeout)))
            (else
              (local.set $later (i64.add (global.get $now) (local.get $timeout)))
              ;; saturate rather than wrap: time never runs backwards
              (if (i64.lt_u (local.get $later) (global.get $now))
                (then (local.set $later (i64.const -1))))))
          (if (i64.gt_u (local.get $later) (global.get $now))
            (then (global.set $now (local.get $later)))))
        (else (i32.store16 offset=8 (local.get $out) (i32.const 8))))
      (local.set $in (i32.add (local.get $in) (i32.const 48)))
      (local.set $out (i32.add (local.get $out) (i32.const 32)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $each (i32.lt_u (local.get $i) (local.get $n))))
    (i32.store (local.get $nevents) (local.get $n))
    (i32.const 0))

  (func (export "proc_exit") (param i32) unreachable)
  (func (export "proc_raise") (param i32) (result i32) (i32.const 52))
  (func (export "sched_yield") (result i32) (i32.const 0))

  ;; No descriptor is open.
  (func (export "fd_advise") (param i32 i64 i64 i32) (result i32) (i32.const 8))
  (func (export "fd_allocate") (param i32 i64 i64) (result i32) (i32.const 8))
  (func (export "fd_close") (param i32) (result i32) (i32.const 8))
  (func (export "fd_datasync") (param i32) (result i32) (i32.const 8))
  (func (export "fd_fdstat_get") (param i32 i32) (result i32) (i32.const 8))
  (func (export "fd_fdstat_set_flags") (param i32 i32) (result i32) (i32.const 8))
  (func (export "fd_fdstat_set_rights") (param i32 i64 i64) (result i32) (i32.const 8))
  (func (export "fd_filestat_get") (param i32 i32) (result i32) (i32.const 8))
  (func (export "fd_filestat_set_size") (param i32 i64) (result i32) (i32.const 8))
  (func (export "fd_filestat_set_times") (param i32 i64 i64 i32) (result i32) (i32.const 8))
  (func (export "fd_pread") (param i32 i32 i32 i64 i32) (result i32) (i32.const 8))
  (func (export "fd_prestat_get") (param i32 i32) (result i32) (i32.const 8))
  (func (export "fd_prestat_dir_name") (param i32 i32 i32) (result i32) (i32.const 8))
  (func (export "fd_pwrite") (param i32 i32 i32 i64 i32) (result i32) (i32.const 8))
  (func (export "fd_read") (param i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "fd_readdir") (param i32 i32 i32 i64 i32) (result i32) (i32.const 8))
  (func (export "fd_renumber") (param i32 i32) (result i32) (i32.const 8))
  (func (export "fd_seek") (param i32 i64 i32 i32) (result i32) (i32.const 8))
  (func (export "fd_sync") (param i32) (result i32) (i32.const 8))
  (func (export "fd_tell") (param i32 i32) (result i32) (i32.const 8))
  (func (export "path_create_directory") (param i32 i32 i32) (result i32) (i32.const 8))
  (func (export "path_filestat_get") (param i32 i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "path_filestat_set_times") (param i32 i32 i32 i32 i64 i64 i32) (result i32) (i32.const 8))
  (func (export "path_link") (param i32 i32 i32 i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "path_open") (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32) (i32.const 8))
  (func (export "path_readlink") (param i32 i32 i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "path_remove_directory") (param i32 i32 i32) (result i32) (i32.const 8))
  (func (export "path_rename") (param i32 i32 i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "path_symlink") (param i32 i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "path_unlink_file") (param i32 i32 i32) (result i32) (i32.const 8))
  (func (export "sock_accept") (param i32 i32 i32) (result i32) (i32.const 8))
  (func (export "sock_recv") (param i32 i32 i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "sock_send") (param i32 i32 i32 i32 i32) (result i32) (i32.const 8))
  (func (export "sock_shutdown") (param i32 i32) (result i32) (i32.const 8))
)
