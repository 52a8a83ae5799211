"""The hand-written SQS consumer that scripts/bench-sqs.sh puts beside sluice: WORKERS threads,
each long-polling up to 10 messages, POSTing each body to the receiver, then deleting what
succeeded in one batch; it exits when the queue stays empty for IDLE seconds.

    python3 bench-sqs-consumer.py ENDPOINT QUEUE_URL RECEIVER_URL WORKERS
"""
import sys
import threading
import time

import boto3
import requests

endpoint, queue_url, receiver, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
IDLE = 2.0
last_seen = [time.monotonic()]
lock = threading.Lock()


def work():
    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1",
                       aws_access_key_id="bench", aws_secret_access_key="bench")
    http = requests.Session()
    while True:
        answer = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                     VisibilityTimeout=30)
        messages = answer.get("Messages", [])
        if not messages:
            with lock:
                if time.monotonic() - last_seen[0] > IDLE:
                    return
            continue
        with lock:
            last_seen[0] = time.monotonic()
        done = []
        for m in messages:
            r = http.post(receiver, data=m["Body"], headers={"content-type": "application/json"})
            if r.status_code < 300:
                done.append({"Id": m["MessageId"], "ReceiptHandle": m["ReceiptHandle"]})
        if done:
            sqs.delete_message_batch(QueueUrl=queue_url, Entries=done)


threads = [threading.Thread(target=work) for _ in range(workers)]
for t in threads:
    t.start()
for t in threads:
    t.join()
