//! The SQS request layer (`sluice::broker::sqs::aws`, issue 36) against moto: SQS's JSON
//! protocol through `Aws::call`, signed with dummy credentials from an environment of the
//! test's own (moto takes any), and SQS's errors as `AwsError::Service` with short codes.

use serde_json::{Value, json};
use sluice::broker::sqs::aws::{Aws, AwsError};

use crate::support;

/// A queue of the test's own on `aws`, deleted on drop.
struct Queue {
    aws: Aws,
    url: String,
}

impl Drop for Queue {
    fn drop(&mut self) {
        let (aws, url) = (self.aws.clone(), self.url.clone());
        // A runtime of its own: drop may run inside the test's, which cannot be blocked on.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            runtime.block_on(aws.call("DeleteQueue", &json!({ "QueueUrl": url })))
        })
        .join();
    }
}

/// A queue named after this test process (SQS allows 80 characters: letters, digits, - and _).
async fn create_queue(aws: &Aws) -> Queue {
    let name = support::owned_name();
    assert!(name.len() <= 80, "{name}");
    let created = aws.call("CreateQueue", &json!({ "QueueName": name })).await.expect("CreateQueue");
    let url = created["QueueUrl"].as_str().unwrap_or_else(|| panic!("no QueueUrl in {created}")).to_string();
    Queue { aws: aws.clone(), url }
}

#[tokio::test]
async fn send_receive_delete_through_signed_json_calls() {
    let aws = Aws::with_env("us-east-1", Some(&support::moto::require_sqs()), support::moto::credentials())
        .expect("a client");
    let queue = create_queue(&aws).await;
    let sent = aws
        .call("SendMessage", &json!({ "QueueUrl": queue.url, "MessageBody": "{\"order\": 7} ünïcode" }))
        .await
        .expect("SendMessage");
    let id = sent["MessageId"].as_str().expect("a MessageId").to_string();

    let received = aws
        .call(
            "ReceiveMessage",
            &json!({ "QueueUrl": queue.url, "MaxNumberOfMessages": 10, "WaitTimeSeconds": 5, "VisibilityTimeout": 30 }),
        )
        .await
        .expect("ReceiveMessage");
    let messages = received["Messages"].as_array().unwrap_or_else(|| panic!("no Messages in {received}"));
    assert_eq!(messages.len(), 1, "{received}");
    assert_eq!(messages[0]["MessageId"], Value::from(id));
    assert_eq!(messages[0]["Body"], "{\"order\": 7} ünïcode");
    let handle = messages[0]["ReceiptHandle"].as_str().expect("a ReceiptHandle");

    let deleted = aws.call("DeleteMessage", &json!({ "QueueUrl": queue.url, "ReceiptHandle": handle })).await;
    assert_eq!(deleted.expect("DeleteMessage"), json!({}));
    let attributes = aws
        .call("GetQueueAttributes", &json!({ "QueueUrl": queue.url, "AttributeNames": ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"] }))
        .await
        .expect("GetQueueAttributes");
    assert_eq!(attributes["Attributes"]["ApproximateNumberOfMessages"], "0", "{attributes}");
    assert_eq!(attributes["Attributes"]["ApproximateNumberOfMessagesNotVisible"], "0", "{attributes}");
}

#[tokio::test]
async fn a_missing_queue_is_queue_does_not_exist() {
    let aws = Aws::with_env("us-east-1", Some(&support::moto::require_sqs()), support::moto::credentials())
        .expect("a client");
    let name = support::owned_name();
    let error = aws.call("GetQueueUrl", &json!({ "QueueName": name })).await.expect_err("no such queue");
    match &error {
        AwsError::Service { code, status, .. } => assert_eq!((code.as_str(), *status), ("QueueDoesNotExist", 400)),
        other => panic!("not a service error: {other:?}"),
    }
    assert!(error.to_string().starts_with("SQS GetQueueUrl failed: QueueDoesNotExist (HTTP 400)"), "{error}");
}

/// A moto of the test's own starts, serves, and is gone once dropped.
#[tokio::test]
async fn a_moto_of_its_own_is_killed_on_drop() {
    let moto = support::moto::Emulator::moto();
    let aws = Aws::with_env("eu-west-1", Some(&moto.endpoint), support::moto::credentials()).expect("a client");
    let listed = aws.call("ListQueues", &json!({})).await.expect("ListQueues");
    assert!(listed.get("QueueUrls").is_none_or(|urls| urls.as_array().is_some_and(Vec::is_empty)), "{listed}");
    let endpoint = moto.endpoint.clone();
    drop(moto);
    let error = aws.call("ListQueues", &json!({})).await.expect_err("moto is gone");
    assert!(matches!(error, AwsError::Transport(_)), "{endpoint}: {error:?}");
}
