use std::io::Write;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::trace::{Event, Mark, TraceError, TraceReader};

/// A binary trace read whole from its bytes.
fn read_binary(input: &[u8]) -> Result<Trace, TraceError> {
    TraceReader::binary(BinaryEvents::read_held(input)?).read_all()
}

/// A well-formed trace: blocks numbered in the order they are made, freed at most
/// once, over a few threads, with marks, times and sites when asked, and with blocks of
/// two GPUs' memory among the host's (frees naming streams) when asked.
fn traces() -> impl Strategy<Value = Trace> {
    let step = (
        0u8..6,
        0usize..64,
        1u64..1 << 20,
        1u32..4,
        any::<u64>(),
        0u32..4,
    );
    (
        proptest::collection::vec(step, 0..200),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(steps, times, sites, devices)| {
            let mut trace = Trace::default();
            let mut live: Vec<(u64, u64, Option<u16>)> = Vec::new();
            let mut next = 1;
            let site_of = |n: u32| Site {
                file: format!("/job/part {n}.py").into(),
                line: n * 10,
                function: "work".into(),
                via: n.is_multiple_of(2).then(|| {
                    Arc::new(Site {
                        file: "/venv/lib/site-packages/lib.py".into(),
                        line: n,
                        function: "inner name".into(),
                        via: None,
                    })
                }),
            };
            let mut time = 0;
            for (kind, pick, size, thread, mark, site) in steps {
                let gpu = (devices && size % 3 != 0).then_some((size % 2) as u16);
                let (op, id, device) = match (kind, live.is_empty()) {
                    (0 | 1, _) | (_, true) => {
                        next += 1;
                        live.push((next - 1, size, gpu));
                        (
                            [EventOp::Malloc, EventOp::Calloc][kind as usize % 2],
                            next - 1,
                            gpu,
                        )
                    }
                    (2, false) => {
                        let at = pick % live.len();
                        live[at].1 = size;
                        (EventOp::Realloc, live[at].0, live[at].2)
                    }
                    (3, false) => (EventOp::Free, 0, None),
                    _ => {
                        let (id, _, device) = live.swap_remove(pick % live.len());
                        (EventOp::Free, id, device)
                    }
                };
                let stream =
                    (op == EventOp::Free && device.is_some() && mark % 3 != 0).then_some(mark % 5);
                if stream.is_some() || !trace.streams.is_empty() {
                    trace.streams.resize(trace.events.len(), None);
                    trace.streams.push(stream);
                }
                if mark.is_multiple_of(7) && !trace.events.is_empty() {
                    trace.marks.push(Mark {
                        at: trace.events.len() as u64,
                        text: format!("test {mark}"),
                    });
                }
                if times {
                    time += mark % 1000;
                    trace.times.push(time);
                }
                if sites {
                    let number = if op == EventOp::Free { 0 } else { site };
                    if number != 0 {
                        trace.site_table.insert(number, site_of(number));
                    }
                    trace.sites.push(number);
                }
                trace.events.push(Event {
                    op,
                    id,
                    size,
                    thread,
                    line: 0,
                    device,
                });
            }
            trace
        })
}

fn binary(trace: &Trace) -> Vec<u8> {
    let mut bytes = Vec::new();
    write_binary(trace, &mut bytes).unwrap();
    bytes
}

/// Events without their lines (a text trace's and a binary one's differ).
fn calls(trace: &Trace) -> Vec<(EventOp, u64, u64, u32, Option<u16>)> {
    trace
        .events
        .iter()
        .map(|e| (e.op, e.id, e.size, e.thread, e.device))
        .collect()
}

/// Each event's stream, `None` for none.
fn streams(trace: &Trace) -> Vec<Option<u64>> {
    (0..trace.events.len())
        .map(|at| trace.streams.get(at).copied().flatten())
        .collect()
}

/// `trace` written as a recording writes it, but each thread's chunk ended every `per`
/// calls, and the chunks of different threads in the file in an order drawn from
/// `order` (each thread's own in order): a file far out of the recording's order.
fn scattered(trace: &Trace, per: usize, order: &[bool]) -> Vec<u8> {
    let flags = if trace.times.is_empty() { 0 } else { TIMES }
        | if trace.sites.is_empty() { 0 } else { SITES };
    let mut encoders: std::collections::BTreeMap<u32, (ChunkEncoder, usize)> = Default::default();
    let mut chunks: std::collections::BTreeMap<u32, Vec<Vec<u8>>> = Default::default();
    let mut marks = trace.marks.iter().peekable();
    for (at, event) in trace.events.iter().enumerate() {
        let seq = 4 * at as u64 + 4;
        let (encoder, calls) = encoders
            .entry(event.thread)
            .or_insert_with(|| (ChunkEncoder::new(event.thread, flags), 0));
        while let Some(mark) = marks.next_if(|m| m.at <= at as u64) {
            encoder.mark(seq - 3, &mark.text);
        }
        let recorded = Recorded {
            event: *event,
            time: trace.times.get(at).copied(),
            site: None,
            stream: trace.streams.get(at).copied().flatten(),
        };
        let site = trace.sites.get(at).and_then(|n| trace.site_table.get(n));
        encoder.call(Call::of(&recorded, site, at as u64));
        *calls += 1;
        if *calls == per {
            *calls = 0;
            chunks
                .entry(event.thread)
                .or_default()
                .extend(encoder.take());
        }
    }
    for (thread, (mut encoder, _)) in encoders {
        chunks.entry(thread).or_default().extend(encoder.take());
    }
    // Marks after the last event: on a chunk of their own.
    if marks.peek().is_some() {
        let mut encoder = ChunkEncoder::new(1, flags);
        for mark in marks {
            encoder.mark(4 * trace.events.len() as u64 + 1, &mark.text);
        }
        chunks.entry(u32::MAX).or_default().extend(encoder.take());
    }
    let mut queues: Vec<std::collections::VecDeque<Vec<u8>>> =
        chunks.into_values().map(Into::into).collect();
    let mut bytes = header(flags).to_vec();
    let mut stream = compressor(&mut bytes).unwrap();
    let mut draw = order.iter().cycle();
    while queues.iter().any(|q| !q.is_empty()) {
        // Each thread's next chunk waits or goes, as drawn; one always goes.
        let mut went = false;
        for queue in queues.iter_mut() {
            if !queue.is_empty() && (*draw.next().unwrap_or(&true) || !went) {
                stream.write_all(&queue.pop_front().unwrap()).unwrap();
                went = true;
            }
        }
    }
    stream.write_all(&END).unwrap();
    stream.finish().unwrap();
    bytes
}

proptest! {
    #[test]
    fn a_trace_written_binary_reads_back_with_every_event_mark_time_and_site(trace in traces()) {
        let back = read_binary(&binary(&trace)[..]).unwrap();
        prop_assert_eq!(calls(&back), calls(&trace));
        prop_assert_eq!(streams(&back), streams(&trace));
        prop_assert_eq!(&back.marks, &trace.marks);
        prop_assert_eq!(&back.times, &trace.times);
        prop_assert!(!back.cut_short);
        prop_assert_eq!(back.sites.len(), trace.sites.len());
        for (read, written) in back.sites.iter().zip(&trace.sites) {
            prop_assert_eq!(back.site_table.get(read), trace.site_table.get(written));
        }
    }

    #[test]
    fn a_binary_trace_s_event_lines_are_those_of_its_text_form(trace in traces()) {
        let back = read_binary(&binary(&trace)[..]).unwrap();
        let mut text = Vec::new();
        super::super::write_text(&back, &mut text).unwrap();
        let reread = super::super::parse_trace_marked(&text[..]).unwrap();
        prop_assert_eq!(calls(&reread), calls(&back));
        prop_assert_eq!(streams(&reread), streams(&back));
        let lines = |t: &Trace| t.events.iter().map(|e| e.line).collect::<Vec<_>>();
        prop_assert_eq!(lines(&reread), lines(&back));
    }

    #[test]
    fn any_bytes_after_the_header_read_or_are_refused_never_a_panic(
        body in proptest::collection::vec(any::<u8>(), 0..512),
        compress in any::<bool>(),
    ) {
        let mut bytes = header(TIMES | SITES).to_vec();
        match compress {
            true => bytes.extend(zstd::bulk::compress(&body, 1).unwrap()),
            false => bytes.extend(&body),
        }
        let held = read_binary(&bytes[..]);
        // From a file, through the decoders that read ahead: the same answer.
        let path = std::env::temp_dir().join(format!(
            "allocbox-any-bytes-{}-{:?}.abt",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&path, &bytes).unwrap();
        let read = TraceReader::open(&path).and_then(TraceReader::read_all);
        std::fs::remove_file(&path).unwrap();
        match (held, read) {
            (Ok(held), Ok(read)) => {
                prop_assert_eq!(held.events, read.events);
                prop_assert_eq!(held.marks, read.marks);
            }
            (Err(_), Err(_)) => {}
            (held, read) => prop_assert!(false, "held {:?}, from a file {:?}", held.err(), read.err()),
        }
    }
}

#[test]
fn calls_from_threads_interleaved_read_back_in_the_order_they_were_numbered() {
    // Thread 2 frees the block thread 1 made, and thread 1 is handed the same
    // address again while thread 2's realloc of another block is under way.
    let mut first = ChunkEncoder::new(1, 0);
    let mut second = ChunkEncoder::new(2, 0);
    let call = |op, seq, done, old, new| Call {
        op,
        seq,
        done,
        old,
        new,
        size: 8,
        time: 0,
        site: None,
        device: None,
        stream: None,
    };
    first.call(call(EventOp::Malloc, 1, 1, 0, 0x1000));
    second.call(call(EventOp::Malloc, 2, 2, 0, 0x2000));
    second.call(call(EventOp::Free, 3, 3, 0x1000, 0));
    second.call(call(EventOp::Realloc, 4, 6, 0x2000, 0x3000));
    first.call(call(EventOp::Malloc, 5, 5, 0, 0x2000));
    let mut bytes = header(0).to_vec();
    let mut stream = compressor(&mut bytes).unwrap();
    // Thread 2's chunk first: the reader orders by number, not by arrival.
    for encoder in [&mut second, &mut first] {
        stream.write_all(&encoder.take().unwrap()).unwrap();
    }
    stream.write_all(&END).unwrap();
    stream.finish().unwrap();
    let trace = read_binary(&bytes[..]).unwrap();
    assert_eq!(
        calls(&trace),
        [
            (EventOp::Malloc, 1, 8, 1, None),
            (EventOp::Malloc, 2, 8, 2, None),
            (EventOp::Free, 1, 8, 2, None),
            (EventOp::Malloc, 3, 8, 1, None),
            (EventOp::Realloc, 2, 8, 2, None),
        ],
        "the address thread 1 is handed again is a new block; the realloc keeps its id"
    );
}

#[test]
fn a_thread_s_early_chunk_written_last_is_read_first_holding_only_the_chunks_that_overlap() {
    // Thread 1 makes a block, then waits while thread 2 fills 100 chunks; its chunk,
    // with the free at the end, is written last, as a recording ends.
    let call = |op, seq, old, new| Call {
        op,
        seq,
        done: seq,
        old,
        new,
        size: 64,
        time: 0,
        site: None,
        device: None,
        stream: None,
    };
    let mut waiting = ChunkEncoder::new(1, 0);
    let mut busy = ChunkEncoder::new(2, 0);
    waiting.call(call(EventOp::Malloc, 1, 0, 0x10));
    let path = std::env::temp_dir().join(format!("allocbox-straggler-{}.abt", std::process::id()));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&header(0)).unwrap();
    let mut stream = compressor(file).unwrap();
    let mut seq = 2;
    for _ in 0..100 {
        for _ in 0..1000 {
            busy.call(call(EventOp::Malloc, seq, 0, 0x2000));
            busy.call(call(EventOp::Free, seq + 1, 0x2000, 0));
            seq += 2;
        }
        stream.write_all(&busy.take().unwrap()).unwrap();
    }
    waiting.call(call(EventOp::Free, seq, 0x10, 0));
    stream.write_all(&waiting.take().unwrap()).unwrap();
    stream.write_all(&END).unwrap();
    stream.finish().unwrap();
    let events = BinaryEvents::open_file(std::sync::Arc::new(std::fs::File::open(&path).unwrap()));
    std::fs::remove_file(&path).unwrap();
    let mut events = events.unwrap();
    let mut beside = crate::trace::recorded::Beside::default();
    let mut read = Vec::new();
    while let Some(recorded) = events.next(&mut beside).unwrap() {
        read.push(recorded.event);
    }
    assert_eq!(read.len(), 200_002);
    assert_eq!(
        (read[0].op, read[0].id, read[0].thread),
        (EventOp::Malloc, 1, 1)
    );
    let last = read.last().unwrap();
    assert_eq!((last.op, last.id, last.thread), (EventOp::Free, 1, 1));
    assert!(read[1..read.len() - 1].iter().all(|e| e.thread == 2));
    // Each busy chunk is ~10 KB, the 101 of them ~1 MB.
    assert!(
        events.most_held_bytes() < 30_000,
        "held {} bytes: the waiting chunk and one of the busy thread's at a time",
        events.most_held_bytes()
    );
    assert_eq!(
        events.decoders(),
        2,
        "one read in order, one for the chunk far ahead"
    );
}

/// A file whose chunks run against the order of their calls (the last written holds the
/// first call, and so on) would take a decoder restarted from the file's start for each
/// chunk: the time of its size squared. It is refused once the decoders have read it 32
/// times over, in a line.
#[test]
fn a_file_of_chunks_in_reverse_order_is_refused_within_a_bounded_reading() {
    let chunks = 2000u64;
    let path = std::env::temp_dir().join(format!("allocbox-reversed-{}.abt", std::process::id()));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&header(0)).unwrap();
    let mut stream = compressor(file).unwrap();
    for at in 0..chunks {
        let thread = at as u32 + 1;
        let mut encoder = ChunkEncoder::new(thread, 0);
        encoder.call(Call {
            op: EventOp::Malloc,
            seq: 2 * (chunks - at),
            done: 2 * (chunks - at),
            old: 0,
            new: 0x1000 * (at + 1),
            size: 8,
            time: 0,
            site: None,
            device: None,
            stream: None,
        });
        stream.write_all(&encoder.take().unwrap()).unwrap();
    }
    stream.write_all(&END).unwrap();
    stream.finish().unwrap();
    let read = TraceReader::open(&path).and_then(TraceReader::read_all);
    std::fs::remove_file(&path).unwrap();
    let error = read.unwrap_err().to_string();
    assert!(
        error.contains("more than 32 times over") && !error.contains('\n'),
        "{error}"
    );
}

#[test]
fn a_recording_cut_short_reads_up_to_its_last_whole_chunk_and_says_so() {
    let mut trace = Trace::default();
    for id in 1..=40_000 {
        trace.events.push(Event {
            op: EventOp::Malloc,
            id,
            size: id * 16,
            thread: 1,
            line: 0,
            device: None,
        });
    }
    let whole = binary(&trace);
    let cut = read_binary(&whole[..whole.len() - 20]).unwrap();
    assert!(cut.cut_short);
    assert!(cut.events.len() < 40_000, "{}", cut.events.len());
    assert_eq!(calls(&cut), calls(&trace)[..cut.events.len()]);
    let mut without_end = header(0).to_vec();
    without_end.extend(zstd::bulk::compress(&[], 1).unwrap());
    assert!(read_binary(&without_end[..]).unwrap().cut_short);
}

/// Issue 72: a 17 KB trace whose stream asked for zstd's largest window made 16
/// decoders hold +2,056 MiB. A window past the bound is refused as the stream starts.
#[test]
fn a_stream_asking_for_a_window_past_the_bound_is_refused_in_one_sentence() {
    let mut bytes = header(0).to_vec();
    let mut encoder = zstd::stream::write::Encoder::new(&mut bytes, 1).unwrap();
    encoder.window_log(27).unwrap();
    let mut body = Vec::new();
    put(&mut body, 1);
    put(&mut body, 1);
    body.push(0);
    encoder.write_all(&body).unwrap();
    encoder.finish().unwrap();
    let error = read_binary(&bytes[..]).unwrap_err().to_string();
    assert_eq!(
        error,
        "the trace's compressed stream asks for a window past the 8 MiB a reader keeps, \
         which allocbox's recorder never does (is this file a recording?)"
    );
}

/// Issue 72: a 17 KB file of 10^8 empty chunks took +2,024 MiB and 31-45 s to index.
/// No recorder writes an empty chunk: the first is refused.
#[test]
fn an_empty_chunk_is_refused_before_any_other_is_indexed() {
    let mut body = Vec::new();
    for _ in 0..1_000_000 {
        put(&mut body, 1);
        put(&mut body, 0);
    }
    let mut bytes = header(0).to_vec();
    bytes.extend(zstd::bulk::compress(&body, 1).unwrap());
    let error = read_binary(&bytes[..]).unwrap_err().to_string();
    assert_eq!(
        error,
        "chunk 1 of the binary trace: it is empty, which no recorder writes (is this file \
         damaged?)"
    );
}

#[test]
fn a_chunk_longer_than_the_bound_is_refused_before_it_is_read() {
    let mut body = Vec::new();
    put(&mut body, 1);
    put(&mut body, MAX_CHUNK_BYTES as u64 + 1);
    let mut bytes = header(0).to_vec();
    bytes.extend(zstd::bulk::compress(&body, 1).unwrap());
    let error = read_binary(&bytes[..]).unwrap_err().to_string();
    assert_eq!(
        error,
        "chunk 1 of the binary trace: the chunk says it is 1048577 bytes long, past the \
         1048576 a chunk may be (is this file damaged?)"
    );
}

#[test]
fn a_newer_version_is_refused_naming_both_versions() {
    let mut bytes = header(0).to_vec();
    bytes[8] = 2;
    let error = read_binary(&bytes[..]).unwrap_err().to_string();
    assert!(
        error.starts_with(
            "the trace is in version 2 of the binary form and this allocbox reads version 1"
        ),
        "{error}"
    );
}

#[test]
fn a_site_met_again_by_the_same_names_keeps_its_number_and_another_gets_its_own() {
    let site = |line| Site {
        file: "/job.py".into(),
        line,
        function: "work".into(),
        via: None,
    };
    let (ten, eleven) = (site(10), site(11));
    // A copy of `ten` with names of its own: equal, not the same `Arc`s.
    let also_ten = site(10);
    let mut encoder = ChunkEncoder::new(1, SITES);
    for (at, site) in [&ten, &ten, &eleven, &ten, &also_ten, &eleven]
        .into_iter()
        .enumerate()
    {
        let at = at as u64 + 1;
        encoder.call(Call {
            op: EventOp::Malloc,
            seq: at,
            done: at,
            old: 0,
            new: 16 * at,
            size: 8,
            time: 0,
            site: Some(site.clone()),
            device: None,
            stream: None,
        });
    }
    let mut bytes = header(SITES).to_vec();
    let mut stream = compressor(&mut bytes).unwrap();
    stream.write_all(&encoder.take().unwrap()).unwrap();
    stream.write_all(&END).unwrap();
    stream.finish().unwrap();
    let trace = read_binary(&bytes[..]).unwrap();
    let lines: Vec<u32> = trace
        .sites
        .iter()
        .map(|n| trace.site_table[n].line)
        .collect();
    assert_eq!(lines, [10, 10, 11, 10, 10, 11]);
    assert_eq!(trace.site_table.len(), 2, "each site named once");
}

#[test]
fn a_site_s_long_names_are_cut_to_the_bound_a_reader_takes() {
    let long = "é".repeat(MAX_NAME_BYTES);
    let mut encoder = ChunkEncoder::new(1, SITES);
    let site = Site {
        file: long.clone().into(),
        line: 1,
        function: "f".into(),
        via: None,
    };
    encoder.call(Call {
        op: EventOp::Malloc,
        seq: 1,
        done: 1,
        old: 0,
        new: 16,
        size: 8,
        time: 0,
        device: None,
        stream: None,
        site: Some(site),
    });
    let mut bytes = header(SITES).to_vec();
    let mut stream = compressor(&mut bytes).unwrap();
    stream.write_all(&encoder.take().unwrap()).unwrap();
    stream.write_all(&END).unwrap();
    stream.finish().unwrap();
    let trace = read_binary(&bytes[..]).unwrap();
    let file = &trace.site_table[&1].file;
    assert_eq!(file.len(), MAX_NAME_BYTES);
    assert!(long.starts_with(&**file));
}

/// Issue 64: a tenth varint byte with more than the 64th bit was read as another
/// number. In the stream's framing and in a chunk alike it is refused.
#[test]
fn a_number_past_64_bits_is_refused_in_the_framing_and_in_a_chunk() {
    let past = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
    let mut bytes = header(0).to_vec();
    bytes.extend(zstd::bulk::compress(&past, 1).unwrap());
    let error = read_binary(&bytes[..]).unwrap_err().to_string();
    assert_eq!(error, "a number runs past 64 bits (is this file damaged?)");
    let mut item = vec![0u8];
    item.extend(past);
    let mut body = Vec::new();
    put(&mut body, 1);
    put(&mut body, item.len() as u64);
    body.extend(&item);
    let mut bytes = header(0).to_vec();
    bytes.extend(zstd::bulk::compress(&body, 1).unwrap());
    let error = read_binary(&bytes[..]).unwrap_err().to_string();
    assert_eq!(
        error,
        "chunk 1 of the binary trace: a number runs past 64 bits"
    );
    // The largest number there is still reads.
    let mut value = 0;
    for (at, byte) in [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            chunk::varint_step(&mut value, 7 * at as u32, byte),
            Ok(at == 9)
        );
    }
    assert_eq!(value, u64::MAX);
}

/// Issue 64: `cat a.bin b.bin` read as `a.bin` alone, silently.
#[test]
fn two_binary_traces_joined_are_refused_in_one_line() {
    let mut trace = Trace::default();
    trace.events.push(Event {
        op: EventOp::Malloc,
        id: 1,
        size: 8,
        thread: 1,
        line: 0,
        device: None,
    });
    let one = binary(&trace);
    let mut joined = one.clone();
    joined.extend(&one);
    let error = read_binary(&joined[..]).unwrap_err().to_string();
    assert_eq!(
        error,
        "the file goes on past the end of its trace (binary traces joined with `cat`?): a \
         binary trace is one recording; give each file on its own"
    );
    assert_eq!(read_binary(&one[..]).unwrap().events.len(), 1);
}

/// A site named again under its number (a recorder never does) takes its own place:
/// one entry, the last definition, whatever the count.
#[test]
fn a_site_defined_again_under_its_number_replaces_itself() {
    let mut chunk = Vec::new();
    for line in 1..=1000u64 {
        chunk.push(SITE);
        put(&mut chunk, 1);
        put(&mut chunk, line);
        for name in ["f", "a.py"] {
            put(&mut chunk, name.len() as u64);
            chunk.extend(name.as_bytes());
        }
        chunk.push(0);
    }
    chunk.extend([0, 1, 2, 8, 1]);
    let mut body = Vec::new();
    put(&mut body, 1);
    put(&mut body, chunk.len() as u64);
    body.extend(&chunk);
    body.extend([0, 0]);
    let mut bytes = header(SITES).to_vec();
    bytes.extend(zstd::bulk::compress(&body, 1).unwrap());
    let trace = read_binary(&bytes[..]).unwrap();
    assert_eq!(trace.site_table.len(), 1);
    assert_eq!(trace.site_table[&trace.sites[0]].line, 1000);
}

/// `docs/traces.md`'s example, byte for byte as the page shows it, reads as the text
/// form the page shows beside it: the format's description and the reader agree.
#[test]
fn the_documented_example_reads_as_the_documented_text() {
    let page = include_str!("../../../../docs/traces.md");
    let block = |language: &str| -> &str {
        let start = page
            .find(&format!("```{language}\n"))
            .unwrap_or_else(|| panic!("docs/traces.md has a ```{language} block"));
        let rest = &page[start + language.len() + 4..];
        &rest[..rest.find("```").unwrap()]
    };
    let hex_of = |line: &str| -> Vec<u8> {
        line.split('#')
            .next()
            .unwrap()
            .split_whitespace()
            .map(|pair| u8::from_str_radix(pair, 16).unwrap())
            .collect()
    };
    let mut lines = block("hex").lines();
    let mut file = hex_of(lines.next().unwrap());
    let stream: Vec<u8> = lines.flat_map(hex_of).collect();
    file.extend(zstd::bulk::compress(&stream, 1).unwrap());
    let trace = read_binary(&file[..]).unwrap();
    let mut text = Vec::new();
    crate::trace::write_text(&trace, &mut text).unwrap();
    assert_eq!(String::from_utf8(text).unwrap(), block("text"));
}

/// Every kind of item a writer puts in a chunk, and every field it writes on a text
/// line, is in `docs/traces.md`'s tables: a new one fails here until the page says
/// what it is.
#[test]
fn the_documented_tables_name_every_item_and_field_a_writer_writes() {
    let page = include_str!("../../../../docs/traces.md");
    for tag in [0, 1, 2, 3, SITE, MARK, PLACE, STREAM] {
        let named =
            page.contains(&format!("\n| `{tag}` ")) || page.contains(&format!(", `{tag}` "));
        assert!(named, "item {tag} is not in the table");
    }
    let mut trace = Trace::default();
    let site = Site {
        file: "a.py".into(),
        line: 1,
        function: "f".into(),
        via: None,
    };
    trace.site_table.insert(1, site);
    for (op, site, stream) in [(EventOp::Malloc, 1, None), (EventOp::Free, 0, Some(3))] {
        trace.times.push(5);
        trace.sites.push(site);
        trace.streams.push(stream);
        trace.events.push(Event {
            op,
            id: 1,
            size: 8,
            thread: 1,
            line: 0,
            device: Some(0),
        });
    }
    let mut text = Vec::new();
    crate::trace::write_text(&trace, &mut text).unwrap();
    let text = String::from_utf8(text).unwrap();
    let mut keys = std::collections::BTreeSet::new();
    for event in text.lines().filter(|line| !line.starts_with('#')) {
        for word in event.split_whitespace().skip(4) {
            keys.insert(word[..=word.find('=').unwrap()].to_string());
        }
    }
    assert_eq!(keys.len(), 4, "{text}");
    for key in keys {
        assert!(
            page.contains(&format!("`{key}")),
            "field `{key}` is not described"
        );
    }
}

proptest! {
    /// Read from a file, chunks far out of order are put back in order by the decoders
    /// that read ahead, as when the whole file is held.
    #[test]
    fn a_file_whose_chunks_are_scattered_reads_as_the_trace_it_was(
        trace in traces(),
        per in 1usize..8,
        order in proptest::collection::vec(any::<bool>(), 1..16),
    ) {
        let bytes = scattered(&trace, per, &order);
        let held = read_binary(&bytes).unwrap();
        let path = std::env::temp_dir().join(format!(
            "allocbox-scattered-{}-{:?}.abt",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&path, &bytes).unwrap();
        let read = TraceReader::open(&path).and_then(TraceReader::read_all);
        std::fs::remove_file(&path).unwrap();
        let read = read.unwrap();
        prop_assert_eq!(calls(&read), calls(&trace));
        prop_assert_eq!(&read.events, &held.events);
        prop_assert_eq!(&read.marks, &trace.marks);
        prop_assert_eq!(&read.times, &trace.times);
        prop_assert_eq!(streams(&read), streams(&trace));
    }
}

/// Issue 74: eight threads making arrays at one line were eight rows of the table by
/// line (`randfill.py:15 create_array 95 MiB 6%` eight times), each thread naming the
/// line under a number of its own. The reader gives one site for one line.
#[test]
fn a_line_every_thread_names_is_one_site_of_the_trace() {
    let site = Site {
        file: "randfill.py".into(),
        line: 15,
        function: "create_array".into(),
        via: None,
    };
    let mut trace = Trace::default();
    trace.site_table.insert(1, site.clone());
    for thread in 1..=8u32 {
        trace.events.push(Event {
            op: EventOp::Malloc,
            id: u64::from(thread),
            size: 64,
            thread,
            line: 0,
            device: None,
        });
        trace.sites.push(1);
    }
    let back = read_binary(&binary(&trace)).unwrap();
    assert_eq!(back.site_table.len(), 1, "{:?}", back.site_table);
    assert_eq!(back.site_table[&1], site);
    assert!(back.sites.iter().all(|&s| s == 1), "{:?}", back.sites);
}
