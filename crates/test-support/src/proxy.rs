//! A TCP proxy on 127.0.0.1, standing for a database endpoint or a network link: it
//! forwards each connection to its target port. Moved, it sends new connections to
//! another target and cuts the open ones at once, as a cloud endpoint does when its
//! primary dies; cut, it closes every connection and refuses new ones.

use std::sync::{Arc, Mutex};

use tokio::{
    net::{TcpListener, TcpStream},
    task::{AbortHandle, JoinHandle},
};

pub struct Proxy {
    port: u16,
    route: Arc<Mutex<Route>>,
    accept: JoinHandle<()>,
}

struct Route {
    /// Where new connections go; `None`: they are closed as soon as accepted.
    target: Option<u16>,
    /// Each open connection's task, which forwards both ways; aborted, it drops (and so
    /// closes) both sockets.
    open: Vec<AbortHandle>,
}

impl Route {
    /// Closes every open connection.
    fn cut_open(&mut self) {
        for connection in self.open.drain(..) {
            connection.abort();
        }
    }
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target` on 127.0.0.1.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let route = Arc::new(Mutex::new(Route {
            target: Some(target),
            open: Vec::new(),
        }));
        let accept = tokio::spawn({
            let route = route.clone();
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    };
                    // The target is read and the connection registered under one lock: a
                    // move either sees it and cuts it, or it goes to the new target.
                    let mut route = route.lock().unwrap();
                    let Some(target) = route.target else {
                        continue;
                    };
                    route.open.retain(|connection| !connection.is_finished());
                    let forwarding = tokio::spawn(forward(client, target));
                    route.open.push(forwarding.abort_handle());
                }
            }
        });
        Self {
            port,
            route,
            accept,
        }
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sends new connections to `target`, and closes those open to the old one.
    pub fn move_to(&self, target: u16) {
        let mut route = self.route.lock().unwrap();
        route.target = Some(target);
        route.cut_open();
    }

    /// Closes every open connection, and every new one as soon as it is accepted.
    pub fn cut(&self) {
        let mut route = self.route.lock().unwrap();
        route.target = None;
        route.cut_open();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.route.lock().unwrap().cut_open();
    }
}

/// Forwards `client` to `target` and back until either side closes; a target that
/// refuses closes the client.
async fn forward(mut client: TcpStream, target: u16) {
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}
