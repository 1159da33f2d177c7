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
        "allocbox: t.trace is both the trace to convert and the output: name another output file"
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
