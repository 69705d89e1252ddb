//! The client's request as the stages after classify hold it: its head, and
//! its body read whole (inference calls) or still streaming (passthrough).

use crate::body::IncomingBody;
use bytes::Bytes;

/// The client's request after classification: its head and its bytes.
pub struct ClientRequest {
    pub head: http::request::Parts,
    pub body: ClientBody,
}

/// The request body as the execute stage will send it.
pub enum ClientBody {
    /// Read whole (inference calls): the exact bytes the client sent, cheap to
    /// send again to a fallback target.
    Buffered(Bytes),
    /// Not read (passthrough): streamed once to one target.
    Streaming(Option<IncomingBody>),
}
