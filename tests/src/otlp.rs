//! An in-process OTLP trace receiver: what an OpenTelemetry Collector does
//! with spans, reduced to keeping them. It answers OTLP/HTTP with protobuf
//! bodies (`POST /v1/traces`) and OTLP/gRPC (`TraceService/Export` over h2c,
//! with gRPC's length-prefixed messages and `grpc-status` trailer) on one
//! port, and decodes every span with `opentelemetry-proto`'s messages.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::{Buf, Bytes};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The gRPC method OTLP/gRPC exporters call.
pub const GRPC_EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// One received span and the resource it came with.
#[derive(Debug, Clone)]
pub struct Received {
    pub span: Span,
    /// The resource's `service.instance.id` (kvmesh: the pod id).
    pub instance: Option<String>,
    /// `grpc` or `http`: how it arrived.
    pub protocol: &'static str,
}

/// A running receiver; stops when dropped.
pub struct Collector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    task: JoinHandle<()>,
}

impl Collector {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn(accept_loop(listener, spans.clone()));
        Self { addr, spans, task }
    }

    /// The `otlp_endpoint` to configure: `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Received {
    /// A string, integer or boolean attribute as text.
    pub fn attr(&self, key: &str) -> Option<String> {
        attr(&self.span.attributes, key)
    }

    pub fn name(&self) -> &str {
        &self.span.name
    }

    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    pub fn parent_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }
}

/// Lower-case hex, as in `traceparent`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attr(kvs: &[KeyValue], key: &str) -> Option<String> {
    let v = kvs
        .iter()
        .find(|kv| kv.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match v {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

async fn accept_loop(listener: TcpListener, spans: Arc<Mutex<Vec<Received>>>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let spans = spans.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req| answer(req, spans.clone()));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
        while conns.try_join_next().is_some() {}
    }
}

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

async fn answer(
    req: Request<Incoming>,
    spans: Arc<Mutex<Vec<Received>>>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let bytes = req.into_body().collect().await.map(|c| c.to_bytes());
    let Ok(mut bytes) = bytes else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    let (protocol, message) = match path.as_str() {
        "/v1/traces" => ("http", bytes),
        GRPC_EXPORT => {
            // One length-prefixed message: a compression flag (0) and a
            // 4-byte big-endian length.
            if bytes.len() < 5 || bytes[0] != 0 {
                return Ok(status(StatusCode::BAD_REQUEST));
            }
            bytes.advance(1);
            let len = bytes.get_u32() as usize;
            ("grpc", bytes.slice(..len.min(bytes.len())))
        }
        _ => return Ok(status(StatusCode::NOT_FOUND)),
    };
    let Ok(req) = ExportTraceServiceRequest::decode(message) else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    {
        let mut out = spans.lock().unwrap();
        for rs in req.resource_spans {
            let instance = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "service.instance.id"));
            for ss in rs.scope_spans {
                for span in ss.spans {
                    out.push(Received {
                        span,
                        instance: instance.clone(),
                        protocol,
                    });
                }
            }
        }
    }
    // ExportTraceServiceResponse with no partial success encodes to nothing.
    Ok(if protocol == "http" {
        let mut r = Response::new(full(Bytes::new()));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-protobuf"),
        );
        r
    } else {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let frames = futures_util::stream::iter([
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 0]))),
            Ok(Frame::trailers(trailers)),
        ]);
        let mut r = Response::new(StreamBody::new(frames).boxed_unsync());
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        r
    })
}

fn full(b: Bytes) -> Body {
    http_body_util::Full::new(b).boxed_unsync()
}

fn status(s: StatusCode) -> Response<Body> {
    let mut r = Response::new(full(Bytes::new()));
    *r.status_mut() = s;
    r
}
