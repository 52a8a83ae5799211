//! Placeholder until the signed client lands: unsigned JSON-protocol calls (moto accepts them).

use std::time::Duration;

use serde_json::Value;

#[derive(Clone)]
pub struct Aws {
    http: reqwest::Client,
    endpoint: String,
}

#[derive(Debug)]
pub enum AwsError {
    Service { code: String, message: String, status: u16 },
    Transport(String),
    Credentials(String),
}

impl std::fmt::Display for AwsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AwsError::Service { code, message, status } => write!(f, "{code} ({status}): {message}"),
            AwsError::Transport(e) | AwsError::Credentials(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for AwsError {}

impl Aws {
    pub fn new(region: &str, endpoint: Option<&str>) -> Result<Aws, AwsError> {
        crate::install_tls_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| AwsError::Transport(e.to_string()))?;
        let endpoint = endpoint.map_or_else(|| format!("https://sqs.{region}.amazonaws.com"), str::to_string);
        Ok(Aws { http, endpoint })
    }

    pub async fn call(&self, action: &str, input: &Value) -> Result<Value, AwsError> {
        let answer = self
            .http
            .post(&self.endpoint)
            .header("X-Amz-Target", format!("AmazonSQS.{action}"))
            .header("Content-Type", "application/x-amz-json-1.0")
            .header(
                "Authorization",
                "AWS4-HMAC-SHA256 Credential=test/20260101/us-east-1/sqs/aws4_request, SignedHeaders=host, Signature=0",
            )
            .body(input.to_string())
            .send()
            .await
            .map_err(|e| AwsError::Transport(e.to_string()))?;
        let status = answer.status().as_u16();
        let text = answer.text().await.map_err(|e| AwsError::Transport(e.to_string()))?;
        let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if status >= 300 {
            let kind = json.get("__type").and_then(Value::as_str).unwrap_or("Unknown");
            let code = kind.rsplit('#').next().unwrap_or(kind).to_string();
            let code = if code.contains("NonExistentQueue") { "QueueDoesNotExist".to_string() } else { code };
            let message =
                json.get("message").or(json.get("Message")).and_then(Value::as_str).unwrap_or(&text).to_string();
            return Err(AwsError::Service { code, message, status });
        }
        Ok(json)
    }
}
