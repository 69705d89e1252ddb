use super::*;

fn request(wire: &[u8]) -> Result<Option<RequestHead>, HeadError> {
    parse_request(&mut BytesMut::from(wire))
}

fn framing(wire: &str) -> Result<Framing, HeadError> {
    request(wire.as_bytes()).map(|h| h.expect("a whole head").framing)
}

fn response(wire: &[u8], method: &Method) -> Result<ResponseHead, HeadError> {
    parse_response(&mut BytesMut::from(wire), method).map(|h| h.expect("a whole head"))
}

#[test]
fn a_request_head_becomes_http_types_and_leaves_its_body() {
    let mut buf = BytesMut::from(
        &b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Multi: 1\r\nx-multi: 2\r\nContent-Length: 4\r\n\r\nbody"[..],
    );
    let h = parse_request(&mut buf).unwrap().unwrap();
    assert_eq!(h.parts.method, Method::POST);
    assert_eq!(h.parts.uri.path(), "/v1/completions");
    assert_eq!(h.parts.uri.query(), Some("x=1"));
    assert_eq!(h.parts.version, Version::HTTP_11);
    assert_eq!(h.parts.headers["host"], "a");
    let multi: Vec<_> = h.parts.headers.get_all("x-multi").iter().collect();
    assert_eq!(multi, ["1", "2"]);
    assert_eq!(h.framing, Framing::Length(4));
    assert!(h.keep_alive);
    assert!(!h.expect_continue);
    assert_eq!(&buf[..], b"body");
}

#[test]
fn a_partial_head_asks_for_more_and_pipelined_heads_come_one_at_a_time() {
    let wire = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\n\r\n";
    for cut in 1..27 {
        assert!(request(&wire[..cut]).unwrap().is_none(), "cut at {cut}");
    }
    let mut buf = BytesMut::from(&wire[..]);
    let a = parse_request(&mut buf).unwrap().unwrap();
    let b = parse_request(&mut buf).unwrap().unwrap();
    assert_eq!((a.parts.uri.path(), b.parts.uri.path()), ("/a", "/b"));
    assert_eq!(a.framing, Framing::Empty);
    assert!(buf.is_empty());
}

#[test]
fn keep_alive_follows_the_version_and_the_connection_field() {
    let ka = |wire: &str| request(wire.as_bytes()).unwrap().unwrap().keep_alive;
    assert!(ka("GET / HTTP/1.1\r\n\r\n"));
    assert!(!ka("GET / HTTP/1.1\r\nConnection: Close\r\n\r\n"));
    assert!(!ka("GET / HTTP/1.1\r\nconnection: upgrade, close\r\n\r\n"));
    assert!(!ka("GET / HTTP/1.0\r\n\r\n"));
    assert!(ka("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
}

#[test]
fn expect_100_continue_is_noticed_in_http_1_1_only() {
    let ec = |wire: &str| request(wire.as_bytes()).unwrap().unwrap().expect_continue;
    assert!(ec(
        "POST / HTTP/1.1\r\nExpect: 100-Continue\r\ncontent-length: 1\r\n\r\n"
    ));
    assert!(!ec(
        "POST / HTTP/1.0\r\nExpect: 100-continue\r\ncontent-length: 1\r\n\r\n"
    ));
}

#[test]
fn request_framing_follows_rfc_9112_and_refuses_ambiguity() {
    assert_eq!(
        framing("POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n"),
        Ok(Framing::Empty)
    );
    assert_eq!(
        framing("POST / HTTP/1.1\r\ncontent-length: 7, 7\r\ncontent-length: 7\r\n\r\n"),
        Ok(Framing::Length(7))
    );
    assert_eq!(
        framing("POST / HTTP/1.1\r\ntransfer-encoding: Chunked\r\n\r\n"),
        Ok(Framing::Chunked)
    );
    for bad in [
        "POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
        "POST / HTTP/1.1\r\ncontent-length: 5, 6\r\n\r\n",
        "POST / HTTP/1.1\r\ncontent-length: +5\r\n\r\n",
        "POST / HTTP/1.1\r\ncontent-length: 0x5\r\n\r\n",
        "POST / HTTP/1.1\r\ncontent-length: 99999999999999999999\r\n\r\n",
        "POST / HTTP/1.1\r\ncontent-length:\r\n\r\n",
        "POST / HTTP/1.1\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
        "POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n",
        "POST / HTTP/1.1\r\ntransfer-encoding: chunked, chunked\r\n\r\n",
        "POST / HTTP/1.1\r\ntransfer-encoding:\r\n\r\n",
    ] {
        assert!(
            matches!(framing(bad), Err(HeadError::Malformed(_))),
            "{bad:?}: {:?}",
            framing(bad)
        );
    }
    for unsupported in [
        "POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n",
        "POST / HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
    ] {
        assert_eq!(framing(unsupported), Err(HeadError::UnsupportedCoding));
    }
    assert_eq!(
        HeadError::UnsupportedCoding.status(),
        StatusCode::NOT_IMPLEMENTED
    );
}

#[test]
fn oversize_heads_and_too_many_fields_are_431() {
    let mut big = b"GET / HTTP/1.1\r\nx-big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', MAX_HEAD_BYTES));
    let e = request(&big).unwrap_err();
    assert_eq!(e, HeadError::TooLarge);
    assert_eq!(e.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    let mut many = b"GET / HTTP/1.1\r\n".to_vec();
    for i in 0..=MAX_HEADERS {
        many.extend_from_slice(format!("x-{i}: v\r\n").as_bytes());
    }
    many.extend_from_slice(b"\r\n");
    assert_eq!(request(&many).unwrap_err(), HeadError::TooManyHeaders);
}

#[test]
fn garbage_is_a_bad_request() {
    for bad in [
        &b"GET / HTTP/2.0\r\n\r\n"[..],
        b"G\x01T / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad name: v\r\n\r\n",
        b"GET / HTTP/1.1\r\nx: a\x00b\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    ] {
        assert!(
            matches!(request(bad), Err(HeadError::Malformed(_))),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn response_framing_follows_the_status_the_method_and_the_fields() {
    let get = Method::GET;
    let r = response(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", &get).unwrap();
    assert_eq!((r.framing, r.keep_alive), (Framing::Length(2), true));
    assert_eq!(r.parts.status, StatusCode::OK);
    let r = response(
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n",
        &Method::HEAD,
    )
    .unwrap();
    assert_eq!(r.framing, Framing::Empty);
    let r = response(b"HTTP/1.1 204 No Content\r\n\r\n", &get).unwrap();
    assert_eq!((r.framing, r.keep_alive), (Framing::Empty, true));
    let r = response(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        &get,
    )
    .unwrap();
    assert_eq!((r.framing, r.keep_alive), (Framing::Chunked, true));
    // No length: the body runs until the close, and the connection is spent.
    let r = response(b"HTTP/1.1 200 OK\r\n\r\n", &get).unwrap();
    assert_eq!((r.framing, r.keep_alive), (Framing::UntilClose, false));
    // Both fields: chunked is read, the connection is not used again.
    let r = response(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n",
        &get,
    )
    .unwrap();
    assert_eq!((r.framing, r.keep_alive), (Framing::Chunked, false));
    let r = response(
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
        &get,
    )
    .unwrap();
    assert_eq!((r.framing, r.keep_alive), (Framing::Empty, false));
    let r = response(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", &get).unwrap();
    assert!(!r.keep_alive);
    // An interim head, then the real one.
    let mut buf = BytesMut::from(
        &b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n"[..],
    );
    let first = parse_response(&mut buf, &get).unwrap().unwrap();
    assert!(first.parts.status.is_informational());
    assert_eq!(first.framing, Framing::Empty);
    let second = parse_response(&mut buf, &get).unwrap().unwrap();
    assert_eq!(second.parts.status, StatusCode::CREATED);
    assert!(matches!(
        response(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", &get),
        Err(HeadError::Malformed(_))
    ));
}
