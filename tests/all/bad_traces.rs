//! Bad traces given to `report` and `replay-trace`: whatever the file holds (a line that
//! expands without end, a million comment lines, random or corrupted bytes, plain or
//! gzip), the command ends with a page, a replay, or exit 2 and one line naming the
//! trace's fault, within a bounded memory.

use std::io::Write;

use proptest::prelude::*;

use super::support::*;

fn gzip(text: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(text).unwrap();
    gz.finish().unwrap()
}

/// Found in issue 52: a small `.gz` trace whose one line expands to gigabytes took
/// +3 GB to read. A line is refused past 64 KiB, having held no more.
#[test]
fn a_gzip_line_that_expands_without_end_is_refused_having_held_a_line_at_most() {
    let dir = tempdir("gz-bomb");
    // 256 MiB of one comment line, in about 256 KiB.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(b"m 1 8\n#").unwrap();
    let chunk = vec![b'x'; 1 << 20];
    for _ in 0..256 {
        gz.write_all(&chunk).unwrap();
    }
    std::fs::write(dir.join("bomb.trace.gz"), gz.finish().unwrap()).unwrap();
    let (code, out, peak) =
        allocbox_cli_peak_rss(&["replay-trace", "bomb.trace.gz", "-p", "default"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("line 2") && out.contains("longer than 65536 bytes"),
        "{out}"
    );
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    assert!(peak < 128 << 10, "reading it held {peak} KiB");
}

/// Found in issue 52: a trace made `report` write a 400 MB page. A mark (a test's
/// start) per event draws one tick a column of the charts, not one per mark.
#[test]
fn a_report_of_a_trace_with_a_mark_per_event_is_a_page_of_bounded_size() {
    let dir = tempdir("many-marks");
    let mut text = String::new();
    for id in 1..=100_000u64 {
        text += &format!("m {id} 64\n# test_{id}\nf {id} 64\n");
    }
    std::fs::write(dir.join("marks.trace"), text).unwrap();
    let (code, out) = allocbox_cli(
        &["report", "marks.trace", "-p", "default", "-o", "page.html"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let page = std::fs::metadata(dir.join("page.html")).unwrap().len();
    assert!(page < 2 << 20, "a page of {page} bytes");
}

/// What the command may end with for any trace: 0, 1 (a handler failed an event), or 2
/// with one line that names the trace's fault.
fn assert_ends_well(dir: &std::path::Path, trace: &str) -> Result<(), TestCaseError> {
    let (code, out) = allocbox_cli(&["replay-trace", trace, "-p", "default"], dir);
    prop_assert!(matches!(code, 0..=2), "exit {code}: {out}");
    prop_assert!(!out.contains("panicked"), "{out}");
    if code == 2 {
        prop_assert_eq!(out.trim().lines().count(), 1, "{}", out);
        prop_assert!(out.contains(trace), "the trace is named: {}", out);
    }
    Ok(())
}

/// A trace's lines: events (valid and not), sites, marks and noise.
fn trace_lines() -> impl Strategy<Value = Vec<u8>> {
    let line = prop_oneof![
        (0u64..20, 0u64..5000, 1u32..4)
            .prop_map(|(id, size, t)| format!("m {id} {size} {t}\n").into_bytes()),
        (0u64..20, 0u64..5000).prop_map(|(id, size)| format!("f {id} {size}\n").into_bytes()),
        (0u64..20, 0u64..5000).prop_map(|(id, size)| format!("r {id} {size} 1 t=5\n").into_bytes()),
        (0u64..20, 0u64..9).prop_map(|(id, n)| format!("c {id} {n} s={n}\n").into_bytes()),
        any::<String>().prop_map(|s| format!("#@site 1 2 {s}\n").into_bytes()),
        any::<String>().prop_map(|s| format!("# {s}\n").into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..64),
    ];
    proptest::collection::vec(line, 0..40).prop_map(|lines| lines.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Issue 52's fuzzing of the tools: random traces, plain and gzip (whole, cut short,
    /// or with bytes flipped), end in a replay or one line, never a panic.
    #[test]
    fn any_trace_plain_or_gzip_ends_in_a_replay_or_one_line_naming_its_fault(
        text in trace_lines(),
        compressed in any::<bool>(),
        cut in any::<prop::sample::Index>(),
        flip in proptest::option::of((any::<prop::sample::Index>(), 1u8..=255)),
    ) {
        let dir = tempdir("random-trace");
        let mut bytes = if compressed { gzip(&text) } else { text };
        if let Some((at, mask)) = flip.filter(|_| !bytes.is_empty()) {
            let at = at.index(bytes.len());
            bytes[at] ^= mask;
        }
        if compressed && cut.index(4) == 0 {
            let keep = cut.index(bytes.len().max(1));
            bytes.truncate(keep);
        }
        std::fs::write(dir.join("t.trace"), &bytes).unwrap();
        assert_ends_well(&dir, "t.trace")?;
    }
}

/// `text` (when it reads as a trace) in the binary form.
fn binary(text: &[u8]) -> Option<Vec<u8>> {
    let trace = allocbox::trace::parse_trace_marked(text).ok()?;
    let mut bytes = Vec::new();
    allocbox::trace::write_binary(&trace, &mut bytes).unwrap();
    Some(bytes)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Binary traces, whole, cut short or with bytes flipped (in the header, the
    /// compressed stream or the chunks), end in a replay or one line, never a panic.
    #[test]
    fn any_binary_trace_whole_cut_or_flipped_ends_in_a_replay_or_one_line_naming_its_fault(
        text in trace_lines(),
        cut in any::<prop::sample::Index>(),
        flip in proptest::option::of((any::<prop::sample::Index>(), 1u8..=255)),
    ) {
        let Some(mut bytes) = binary(&text) else {
            return Ok(());
        };
        if let Some((at, mask)) = flip {
            let at = at.index(bytes.len());
            bytes[at] ^= mask;
        }
        if cut.index(4) == 0 {
            let keep = cut.index(bytes.len());
            bytes.truncate(keep);
        }
        let dir = tempdir("random-binary-trace");
        std::fs::write(dir.join("t.trace"), &bytes).unwrap();
        assert_ends_well(&dir, "t.trace")?;
    }
}

/// A binary trace whose chunk says it is gigabytes long is refused by that length,
/// before anything of it is held, in one line naming the trace and the chunk.
#[test]
fn a_binary_chunk_longer_than_the_bound_is_refused_having_held_nothing_of_it() {
    let dir = tempdir("binary-bomb");
    let mut bytes = binary(b"m 1 8\n").unwrap();
    let header = bytes[..10].to_vec();
    // Thread 1, 4 GiB long, then 256 MiB of zeros: about 8 KiB compressed.
    let mut body = vec![1u8, 0x80, 0x80, 0x80, 0x80, 0x10];
    body.extend(vec![0u8; 256 << 20]);
    bytes = header;
    bytes.extend(zstd_compress(&body));
    std::fs::write(dir.join("bomb.trace"), bytes).unwrap();
    let (code, out, peak) =
        allocbox_cli_peak_rss(&["replay-trace", "bomb.trace", "-p", "default"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("bomb.trace")
            && out.contains("chunk 1 of the binary trace")
            && out.contains("past the 1048576 a chunk may be"),
        "{out}"
    );
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    assert!(peak < 128 << 10, "reading it held {peak} KiB");
}

fn zstd_compress(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut encoder = zstd::stream::write::Encoder::new(&mut out, 19).unwrap();
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap();
    out
}

/// `trace-convert` never writes over the trace it reads, and a trace it cannot read
/// leaves the output as it was.
#[test]
fn trace_convert_refuses_its_input_as_output_and_leaves_an_output_whole_on_a_bad_trace() {
    let dir = tempdir("convert");
    std::fs::write(dir.join("t.trace"), "m 1 8\nf 1 8\n").unwrap();
    let (code, out) = allocbox_cli(&["trace-convert", "t.trace", "./t.trace"], &dir);
    assert_eq!(code, 2, "{out}");
    assert_eq!(
        out.trim(),
        "allocbox: cannot write `./t.trace`: it is `t.trace`, which this command reads; name \
         another file"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("t.trace")).unwrap(),
        "m 1 8\nf 1 8\n"
    );
    std::fs::write(dir.join("bad.trace"), "m 1 8\nx\n").unwrap();
    std::fs::write(dir.join("out.trace"), "kept").unwrap();
    let (code, out) = allocbox_cli(&["trace-convert", "bad.trace", "out.trace"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("bad.trace") && out.contains("line 2"), "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.join("out.trace")).unwrap(),
        "kept"
    );
    let (code, out) = allocbox_cli(&["trace-convert", "missing.trace", "out.trace"], &dir);
    assert_eq!(code, 2, "{out}");
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    assert!(out.contains("missing.trace"), "{out}");
}

/// A binary trace made by hand: its items, framed into chunks of thread 1 as a recorder
/// frames them, then compressed behind the header.
struct BinaryBomb {
    stream: Vec<u8>,
    chunk: Vec<u8>,
}

fn put(bytes: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        bytes.push(value as u8 | 0x80);
        value >>= 7;
    }
    bytes.push(value as u8);
}

fn put_str(bytes: &mut Vec<u8>, text: &[u8]) {
    put(bytes, text.len() as u64);
    bytes.extend_from_slice(text);
}

impl BinaryBomb {
    fn new() -> BinaryBomb {
        BinaryBomb {
            stream: Vec::new(),
            chunk: Vec::new(),
        }
    }

    fn item(&mut self, item: &[u8]) {
        if self.chunk.len() + item.len() > 64 << 10 {
            self.flush();
        }
        self.chunk.extend_from_slice(item);
    }

    /// The chunk so far, framed; none when it is empty, as a recorder writes none.
    fn flush(&mut self) {
        if self.chunk.is_empty() {
            return;
        }
        put(&mut self.stream, 1);
        put(&mut self.stream, self.chunk.len() as u64);
        self.stream.append(&mut self.chunk);
    }

    /// The file: the header (sites on every allocation), the chunks, the end.
    fn finish(mut self) -> Vec<u8> {
        self.flush();
        self.stream.extend([0, 0]);
        let mut file = allocbox::trace::BINARY_MAGIC.to_vec();
        file.extend([1, 2]);
        file.extend(zstd_compress(&self.stream));
        file
    }
}

/// A site record of thread 1: its number, a line, a function and a file.
fn site_item(local: u64, function: &[u8], file: &[u8]) -> Vec<u8> {
    let mut item = vec![4];
    put(&mut item, local);
    put(&mut item, 7);
    put_str(&mut item, function);
    put_str(&mut item, file);
    item.push(0);
    item
}

/// A malloc of thread 1 at the next sequence number and a new address, made at `site`.
fn malloc_item(site: u64) -> Vec<u8> {
    let mut item = vec![0, 1, 0x80, 0x01, 64];
    put(&mut item, site);
    item
}

/// The shapes of trace that cost the most to hold for the fewest bytes of file.
#[derive(Debug, Clone, Copy)]
enum Bomb {
    /// Millions of empty marks.
    Marks,
    /// One site defined again and again under the same number.
    Redefinitions,
    /// Millions of sites, each under a number of its own.
    Sites,
}

const BOMB_COUNT: u64 = 2_000_000;

fn binary_bomb(shape: Bomb) -> Vec<u8> {
    let mut bomb = BinaryBomb::new();
    bomb.item(&site_item(1, b"f", b"a.py"));
    bomb.item(&malloc_item(1));
    for local in 1..=BOMB_COUNT {
        match shape {
            Bomb::Marks => bomb.item(&[5, 1, 0]),
            Bomb::Redefinitions => bomb.item(&site_item(1, b"f", b"a.py")),
            Bomb::Sites => bomb.item(&site_item(local + 1, b"f", b"a.py")),
        }
    }
    bomb.item(&malloc_item(1));
    bomb.finish()
}

fn text_bomb(shape: Bomb) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(b"#@site 1 7 f a.py\nm 1 64 1 s=1\n").unwrap();
    for number in 1..=BOMB_COUNT {
        match shape {
            Bomb::Marks => gz.write_all(b"#\n").unwrap(),
            Bomb::Redefinitions => gz.write_all(b"#@site 1 7 f a.py\n").unwrap(),
            Bomb::Sites => writeln!(gz, "#@site {} 7 f a.py", number + 1).unwrap(),
        }
    }
    gz.write_all(b"m 2 64 1 s=1\n").unwrap();
    gz.finish().unwrap()
}

/// Issue 64: a 2.5 KB binary trace of 10^7 empty marks cost +830 MiB to read, 3.4 KB of
/// 5 x 10^6 redefinitions of one site +917 MiB (their gzip text forms +306 MiB). Each
/// shape, in either form, reads within one bound: marks past theirs counted and summed
/// by one mark, a site defined again in its own place, sites past theirs counted.
#[test]
fn every_bomb_shape_in_either_form_is_read_within_a_memory_bound() {
    let dir = tempdir("bombs");
    for shape in [Bomb::Marks, Bomb::Redefinitions, Bomb::Sites] {
        for (form, bytes) in [("binary", binary_bomb(shape)), ("text", text_bomb(shape))] {
            let name = format!("{shape:?}-{form}.trace");
            std::fs::write(dir.join(&name), bytes).unwrap();
            let (code, out, peak) =
                allocbox_cli_peak_rss(&["replay-trace", &name, "-p", "default"], &dir);
            assert_eq!(code, 0, "{name}: {out}");
            assert!(peak < 128 << 10, "{name}: reading it held {peak} KiB");
            match shape {
                Bomb::Marks => assert!(
                    out.contains(&format!(
                        "has {} marks past the 100000",
                        BOMB_COUNT - 100_000
                    )),
                    "{name}: {out}"
                ),
                Bomb::Redefinitions => assert!(!out.contains("past the"), "{name}: {out}"),
                Bomb::Sites => assert!(
                    out.contains(&format!(
                        "names {} sites past the 262144",
                        BOMB_COUNT + 1 - 262_144
                    )),
                    "{name}: {out}"
                ),
            }
        }
    }
}

/// Issue 64: 500 sites with 64 KiB names of control characters made a 27.5 MB page. A
/// name is cut to the recorder's 16 KiB when read and a table shows its first
/// characters, whatever its escapes.
#[test]
fn a_page_of_sites_with_the_longest_names_is_of_bounded_size() {
    let dir = tempdir("long-names");
    let mut bomb = BinaryBomb::new();
    let name = vec![1u8; 60 << 10];
    for local in 1..=500 {
        bomb.item(&site_item(local, &name, &name));
        bomb.item(&malloc_item(local));
    }
    std::fs::write(dir.join("names.trace"), bomb.finish()).unwrap();
    let trace = allocbox::trace::read_trace_marked(dir.join("names.trace")).unwrap();
    let site = &trace.site_table[&1];
    assert_eq!(
        site.file.len(),
        allocbox::trace::MAX_NAME_BYTES * "\\u{1}".len()
    );
    let (code, out) = allocbox_cli(
        &["report", "names.trace", "-p", "default", "-o", "page.html"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let page = std::fs::metadata(dir.join("page.html")).unwrap().len();
    assert!(page < 1 << 20, "a page of {page} bytes");
}
