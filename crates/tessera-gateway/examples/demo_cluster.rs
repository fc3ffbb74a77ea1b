//! Serves the gateway in front of the in-memory cluster twin (three nodes, a stage-split plan)
//! to see the dashboard as a cluster will look, without running nodes:
//!
//! ```text
//! cargo run -p tessera-gateway --example demo_cluster -- models/stories260K.gguf 127.0.0.1:8080
//! ```

use std::sync::Arc;
use std::time::Duration;

use tessera_api::ServedModel;
use tessera_gateway::testing::{three_node_status, ScriptedBackend};
use tessera_gateway::{Gateway, GatewayConfig};
use tessera_model::GgufFile;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .map_or("models/stories260K.gguf", String::as_str);
    let listen = args.get(2).map_or("127.0.0.1:8080", String::as_str);
    let served =
        ServedModel::from_gguf("demo", &GgufFile::open(path).unwrap(), usize::MAX).unwrap();
    let script = served
        .tokenizer
        .encode("Once upon a time there was a little robot.", false);
    let backend = ScriptedBackend::new(served, three_node_status("demo", 36), script)
        .paced(Duration::from_millis(20));
    let gateway = Gateway::new(Arc::new(backend), GatewayConfig::default());
    let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
    println!("listening on http://{}", listener.local_addr().unwrap());
    tessera_gateway::serve(listener, gateway, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    .unwrap();
}
