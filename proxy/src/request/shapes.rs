//! Chat and `/v1/responses` bodies whose template input is more than plain
//! messages: read a second time, into `kvmesh_filters`' order-keeping
//! [`Json`], and turned into the [`ChatInput`] vLLM renders
//! (`kvmesh_filters::prefix::tokenize::ChatInput` says how, field by field).
//!
//! Only bodies that need it pay for the second read: a chat request whose
//! messages are role and text alone keeps the quick path of `view.rs`. A
//! body that cannot be keyed exactly (a non-text part, a field vLLM refuses,
//! a Responses item kvmesh does not render) is still routed: `view.rs`
//! keeps its text, and the reason goes with it.

use kvmesh_filters::prefix::tokenize::{ChatInput, ChatMessage, Inexact, Json};

/// The template input of a chat completion body.
pub(super) fn chat(body: &[u8]) -> Result<ChatInput, Inexact> {
    let json: Json = serde_json::from_slice(body).map_err(|_| Inexact::Unsupported)?;
    ChatInput::from_chat_body(&json)
}

/// A `/v1/responses` body: the messages' text (the template input's when
/// it can be built, else whatever text the body holds), the template input
/// or why there is none, and `max_output_tokens` (read here, not with the
/// other shapes' fields, so that a chat body's stray field of that name is
/// not held to a type).
pub(super) fn responses(
    body: &[u8],
) -> (Vec<ChatMessage>, Result<ChatInput, Inexact>, Option<u64>) {
    let Ok(json) = serde_json::from_slice::<Json>(body) else {
        return (Vec::new(), Err(Inexact::Unsupported), None);
    };
    let limit = match json.field("max_output_tokens") {
        Some(Json::Number(n)) => n.as_u64(),
        _ => None,
    };
    match ChatInput::from_responses_body(&json) {
        Ok(input) => (input.flat(), Ok(input), limit),
        Err(reason) => (responses_text(&json), Err(reason), limit),
    }
}

/// The text of a Responses body kvmesh cannot render as vLLM does: the
/// instructions, a string input, and each item's role and text, for
/// approximate keys.
fn responses_text(body: &Json) -> Vec<ChatMessage> {
    let msg = |role: &str, content: String| ChatMessage {
        role: role.to_owned(),
        content,
    };
    let mut out = Vec::new();
    if let Some(i) = body.field("instructions").and_then(Json::as_str) {
        out.push(msg("system", i.to_owned()));
    }
    match body.field("input") {
        Some(Json::String(s)) => out.push(msg("user", s.clone())),
        Some(Json::Array(items)) => {
            for item in items {
                let text = match item.field("content") {
                    Some(Json::String(s)) => s.clone(),
                    Some(Json::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.field("text").and_then(Json::as_str))
                        .collect::<Vec<_>>()
                        .join("\n"),
                    _ => match (item.field("output"), item.field("arguments")) {
                        (Some(Json::String(s)), _) | (None, Some(Json::String(s))) => s.clone(),
                        _ => continue,
                    },
                };
                let role = item.field("role").and_then(Json::as_str).unwrap_or("tool");
                out.push(msg(role, text));
            }
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::view::{Prompt, RequestView, Shape};
    use super::*;

    #[test]
    fn plain_chat_keeps_the_quick_path_and_tools_take_the_template_path() {
        let plain = br#"{"messages":[{"role":"user","content":"hi"}],"temperature":0,"response_format":{"type":"json_object"},"tool_choice":"none"}"#;
        let v = RequestView::parse(plain, Shape::Chat).unwrap();
        assert_eq!(
            v.chat, None,
            "response_format and tool_choice change no prompt"
        );
        assert_eq!(v.inexact, None);
        let tools = br#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2}}}]}"#;
        let v = RequestView::parse(tools, Shape::Chat).unwrap();
        let input = v.chat.unwrap();
        let params = input.tools.as_ref().unwrap().as_array().unwrap()[0]
            .get("function")
            .unwrap()
            .get("parameters")
            .unwrap();
        let keys: Vec<&str> = params
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(
            keys,
            ["z", "a"],
            "the client's key order, as tojson prints it"
        );
        assert_eq!(v.inexact, None);
        for beyond in [
            r#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false}}"#,
            r#"{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}"#,
            r#"{"messages":[{"role":"tool","tool_call_id":"1","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}],"continue_final_message":true,"add_generation_prompt":false}"#,
        ] {
            let v = RequestView::parse(beyond.as_bytes(), Shape::Chat).unwrap();
            assert!(v.chat.is_some(), "{beyond}");
        }
    }

    #[test]
    fn images_keep_their_text_and_say_why() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:,"}}]}]}"#;
        let v = RequestView::parse(body, Shape::Chat).unwrap();
        assert_eq!(v.inexact, Some(Inexact::Multimodal));
        assert_eq!(v.chat, None);
        let Prompt::Chat(ms) = &v.prompt else {
            panic!("not chat")
        };
        assert_eq!(ms[0].content, "look");
    }

    #[test]
    fn responses_become_messages() {
        let body = br#"{"model":"m","instructions":"be brief","input":"hi","max_output_tokens":7,"stream":true}"#;
        let v = RequestView::parse(body, Shape::Responses).unwrap();
        assert_eq!(v.max_tokens, Some(7));
        assert!(v.stream);
        assert_eq!(v.inexact, None);
        let Prompt::Chat(ms) = &v.prompt else {
            panic!("not chat")
        };
        assert_eq!(
            (ms[0].role.as_str(), ms[0].content.as_str()),
            ("system", "be brief")
        );
        assert_eq!(
            (ms[1].role.as_str(), ms[1].content.as_str()),
            ("user", "hi")
        );
        assert!(v.chat.unwrap().add_special_tokens);
        // History on the engine: keyed on the text that came, and counted.
        let body = br#"{"input":[{"role":"user","content":[{"type":"input_text","text":"again"}]}],"previous_response_id":"resp_1"}"#;
        let v = RequestView::parse(body, Shape::Responses).unwrap();
        assert_eq!(v.inexact, Some(Inexact::PreviousResponse));
        let Prompt::Chat(ms) = &v.prompt else {
            panic!("not chat")
        };
        assert_eq!(ms[0].content, "again");
        // No input at all: nothing to key.
        let v = RequestView::parse(br#"{"model":"m"}"#, Shape::Responses).unwrap();
        assert_eq!(v.prompt, Prompt::None);
    }
}
