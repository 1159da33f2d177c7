//! `wasi:io` without waiting: poll and streams over wasmtime-wasi-io's own
//! implementation, with every operation that could wait run once on the calling thread.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use wasmtime::component::{HasData, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::sync as wasi;
use wasmtime_wasi::p2::{DynOutputStream, DynPollable, StreamError, StreamResult};
use wasmtime_wasi_io::bindings::wasi::io as async_io;

/// `wasi:io/poll` and `wasi:io/streams` over wasmtime-wasi-io's own implementation, but
/// every operation that could wait is run once, on this thread, and never waits: the
/// sync bindings would otherwise run it on a multi-threaded tokio runtime that a guest
/// could start in the host, and block this thread until it completes.
pub(super) struct NoWait;

impl HasData for NoWait {
    type Data<'a> = NoWaitView<'a>;
}

pub(super) struct NoWaitView<'a>(pub(super) &'a mut ResourceTable);

/// Run `future` once. Every pollable and stream the host hands a guest is ready at
/// once (see the module doc), so one poll completes it; one that does not is a guest
/// asking the host to wait, which it never does.
fn at_once<F: Future>(future: F) -> wasmtime::Result<F::Output> {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(out) => Ok(out),
        Poll::Pending => Err(wasmtime::format_err!(
            "the guest waited on something that is not ready, and the host never waits"
        )),
    }
}

/// As [`at_once`], for a stream operation whose own result is a stream error.
fn stream_at_once<T, F: Future<Output = StreamResult<T>>>(future: F) -> StreamResult<T> {
    at_once(future).map_err(StreamError::Trap)?
}

impl wasi::io::poll::Host for NoWaitView<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        at_once(async_io::poll::Host::poll(self.0, pollables))?
    }
}

impl wasi::io::poll::HostPollable for NoWaitView<'_> {
    fn ready(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<bool> {
        at_once(async_io::poll::HostPollable::ready(self.0, pollable))?
    }
    fn block(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        at_once(async_io::poll::HostPollable::block(self.0, pollable))?
    }
    fn drop(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        async_io::poll::HostPollable::drop(self.0, pollable)
    }
}

type InputStream = wasmtime_wasi::p2::DynInputStream;

impl wasi::io::streams::Host for NoWaitView<'_> {
    fn convert_stream_error(
        &mut self,
        err: StreamError,
    ) -> wasmtime::Result<wasi::io::streams::StreamError> {
        Ok(
            match async_io::streams::Host::convert_stream_error(self.0, err)? {
                async_io::streams::StreamError::Closed => wasi::io::streams::StreamError::Closed,
                async_io::streams::StreamError::LastOperationFailed(e) => {
                    wasi::io::streams::StreamError::LastOperationFailed(e)
                }
            },
        )
    }
}

impl wasi::io::streams::HostOutputStream for NoWaitView<'_> {
    fn drop(&mut self, stream: Resource<DynOutputStream>) -> wasmtime::Result<()> {
        at_once(async_io::streams::HostOutputStream::drop(self.0, stream))?
    }
    fn check_write(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<u64> {
        async_io::streams::HostOutputStream::check_write(self.0, stream)
    }
    fn write(&mut self, stream: Resource<DynOutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        async_io::streams::HostOutputStream::write(self.0, stream, bytes)
    }
    fn blocking_write_and_flush(
        &mut self,
        stream: Resource<DynOutputStream>,
        bytes: Vec<u8>,
    ) -> StreamResult<()> {
        stream_at_once(
            async_io::streams::HostOutputStream::blocking_write_and_flush(self.0, stream, bytes),
        )
    }
    fn flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        async_io::streams::HostOutputStream::flush(self.0, stream)
    }
    fn blocking_flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        stream_at_once(async_io::streams::HostOutputStream::blocking_flush(
            self.0, stream,
        ))
    }
    fn subscribe(
        &mut self,
        stream: Resource<DynOutputStream>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        async_io::streams::HostOutputStream::subscribe(self.0, stream)
    }
    fn write_zeroes(&mut self, stream: Resource<DynOutputStream>, len: u64) -> StreamResult<()> {
        async_io::streams::HostOutputStream::write_zeroes(self.0, stream, len)
    }
    fn blocking_write_zeroes_and_flush(
        &mut self,
        stream: Resource<DynOutputStream>,
        len: u64,
    ) -> StreamResult<()> {
        stream_at_once(
            async_io::streams::HostOutputStream::blocking_write_zeroes_and_flush(
                self.0, stream, len,
            ),
        )
    }
    fn splice(
        &mut self,
        dst: Resource<DynOutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        async_io::streams::HostOutputStream::splice(self.0, dst, src, len)
    }
    fn blocking_splice(
        &mut self,
        dst: Resource<DynOutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        stream_at_once(async_io::streams::HostOutputStream::blocking_splice(
            self.0, dst, src, len,
        ))
    }
}

impl wasi::io::streams::HostInputStream for NoWaitView<'_> {
    fn drop(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<()> {
        at_once(async_io::streams::HostInputStream::drop(self.0, stream))?
    }
    fn read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        async_io::streams::HostInputStream::read(self.0, stream, len)
    }
    fn blocking_read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        stream_at_once(async_io::streams::HostInputStream::blocking_read(
            self.0, stream, len,
        ))
    }
    fn skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        async_io::streams::HostInputStream::skip(self.0, stream, len)
    }
    fn blocking_skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        stream_at_once(async_io::streams::HostInputStream::blocking_skip(
            self.0, stream, len,
        ))
    }
    fn subscribe(
        &mut self,
        stream: Resource<InputStream>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        async_io::streams::HostInputStream::subscribe(self.0, stream)
    }
}
