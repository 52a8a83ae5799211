//! Amazon SQS as a broker (issue 36), over [`aws`]: signed requests of SQS's JSON protocol.

pub mod aws;
