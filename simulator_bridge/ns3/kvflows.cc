// kvflows: bulk TCP flows on a leaf-spine fabric, each on the spine it is given.
//
// Built by simulator_bridge/ns3_backend.py against the PyPI ns3 wheel and cached;
// run once per replay. Input: one flow per line "id src_host dst_host spine bytes
// start_s [conn]" (spine -1: within a leaf). Flows with the same conn (>= 0), source,
// destination and spine share one TCP connection, as a lane's pushes share its stream:
// the sender writes their bytes in turns of kSlice (a flow with bytes left each turn),
// a turn only while less than kSlice of the connection's bytes is unsent in its socket
// (on a connection that will carry more than one flow), so a later flow's turn comes
// within about two slices, as UCX interleaves a lane's WRITEs in fragments (a
// socket-sized write would queue a flow that fits the buffer whole ahead of it),
// and a flow is done when its last byte is received and every flow that started
// before it on the connection is done (a lane's transfers complete in order). A flow
// that starts when every earlier one has been done for at least the minimum RTO opens
// a new connection: ns-3's TCP, sent new data on a connection idle for longer than its
// RTO, waited for about five RTO back-offs before any of it was acknowledged (no
// packet dropped; a 280 KB flow at 0.2 Gbit/s took 0.94 s), where Linux restarts slow
// start after such an idle, as a new connection does. Without a conn (or -1) a flow
// has a connection of its own. Output: one line per flow "id fct_s" (fct -1:
// it did not finish before the horizon). Progress goes to stderr as "progress DONE N",
// then "stats drops N", "stats conn_failed N" (connections TCP gave up on), "stats tier_drops TIER N" (the queue discs' drops per tier of
// port: host_up, leaf_down, leaf_up, spine_down) and "stats uplink LEAF SPINE BYTES"
// (bytes sent leaf -> spine, headers included), so a caller can check each flow
// crossed the spine it was given.
//
// Routing is by rule on hierarchical addresses, with no global routing tables:
// host h under leaf l owns one address per spine s, 10.(s+1).l.(h+1). A leaf sends
// 10.(s+1).0.0/16 up to spine s and keeps /32s for its own hosts; spine s sends
// 10.(s+1).l.0/24 down to leaf l. A flow on spine s binds its source to its host's
// spine-s address and connects to the destination's spine-s address, so data and
// ACKs both cross spine s, and set-up is O(hosts x spines) static routes.
//
// Every egress port is a buffer of --queueBytes, but a host's own port, which with
// --losslessHost (the default) holds all its connections' buffers, and with --fairHost
// (the default) serves its connections in turn (FQ-CoDel whose CoDel practically
// never acts; Linux's TCP small queues interleave a host's sockets in its qdisc).
// With --burstBytes > 0 it is a token
// bucket instead, as the testbed's tbf shaping is: a TbfQueueDisc at the link's rate
// with that bucket, in front of a device --lineX times faster, so a port idle long
// enough lets a burst through at (near) line speed and then paces at the link rate.

#include "ns3/applications-module.h"
#include "ns3/core-module.h"
#include "ns3/internet-module.h"
#include "ns3/network-module.h"
#include "ns3/point-to-point-module.h"
#include "ns3/traffic-control-module.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <cstdint>
#include <tuple>
#include <vector>

using namespace ns3;

namespace
{

const uint16_t kPort = 5600;
const uint32_t kChunk = 1 << 20; // bytes handed to the socket per Send
const uint32_t kSlice = 64 << 10; // a flow's turn on a connection that others share

struct Flow
{
    uint64_t id;
    uint32_t src, dst;
    int32_t spine;
    uint64_t bytes;
    double start;
    int64_t conn = -1;
    uint64_t sent = 0;
    uint64_t stream_end = UINT64_MAX; // its connection's byte count after its last byte
    double end = -1;
};

// One TCP connection and the flows it carries, in the order they started.
struct Conn
{
    Ptr<Socket> socket;
    bool connected = false;
    uint32_t flows = 0;           // how many flows it will carry (known up front)
    std::vector<uint32_t> order;  // the flows started so far, in start order
    uint32_t written_flows = 0;   // flows whose every byte is written
    size_t turn = 0;              // order[turn] writes next
    uint64_t written = 0;         // payload bytes handed to the socket
    size_t done = 0;              // order[done] is the first flow not yet done
    uint64_t rcvd = 0;            // payload bytes received on it
    double idle_since = 0;        // when its last flow was done
    SequenceNumber32 high_tx;     // after the highest byte TCP has sent (never moves back)
    bool sending = false;         // high_tx has been reported
};

std::vector<Flow> g_flows;
std::vector<Conn> g_conns;
std::vector<uint32_t> g_conn_of;                                 // flow -> its connection
std::map<std::pair<uint32_t, uint16_t>, uint32_t> g_by_source; // (source ip, port) -> connection
NodeContainer g_hosts;
uint32_t g_hpl = 1;
uint32_t g_done = 0;
double g_min_rto_s = 0.005;
uint32_t g_reported = 0;
uint64_t g_drops = 0;
uint64_t g_failed = 0;
const uint64_t kMaxQueue = UINT32_MAX - 65536; // a queue disc's size is 32 bits; room for one more packet

std::vector<uint64_t> g_uplink_bytes; // leaf l -> spine s at l * spines + s

void
OnDrop(Ptr<const Packet>)
{
    ++g_drops;
}

// drops per tier of egress port: a host's port to its leaf, a leaf's to a host, a
// leaf's uplink to a spine, a spine's downlink to a leaf
enum Tier : uint32_t
{
    kHostUp,
    kLeafDown,
    kLeafUp,
    kSpineDown,
    kTiers
};
const char* const kTierNames[kTiers] = {"host_up", "leaf_down", "leaf_up", "spine_down"};
uint64_t g_tier_drops[kTiers] = {0, 0, 0, 0};

void
OnQueueDiscDrop(uint32_t tier, Ptr<const QueueDiscItem>)
{
    ++g_drops;
    ++g_tier_drops[tier];
}

void
OnUplinkTx(uint32_t link, Ptr<const Packet> p)
{
    g_uplink_bytes[link] += p->GetSize();
}

Ipv4Address
DataAddress(uint32_t spine, uint32_t host)
{
    uint32_t leaf = host / g_hpl;
    uint32_t idx = host % g_hpl;
    return Ipv4Address((10u << 24) | ((spine + 1) << 16) | (leaf << 8) | (idx + 1));
}

// payload bytes handed to the connection's socket that TCP has not sent yet
uint32_t
Unsent(const Conn& k)
{
    Ptr<TcpTxBuffer> tx = DynamicCast<TcpSocketBase>(k.socket)->GetTxBuffer();
    if (!k.sending)
    {
        return tx->Size();
    }
    int32_t ahead = tx->TailSequence() - k.high_tx;
    return ahead > 0 ? static_cast<uint32_t>(ahead) : 0;
}

void
HighTx(uint32_t c, const Socket* socket, SequenceNumber32, SequenceNumber32 high)
{
    if (PeekPointer(g_conns[c].socket) != socket)
    {
        return; // a connection closed after an idle: its FIN or a retransmission
    }
    g_conns[c].high_tx = high;
    g_conns[c].sending = true;
}

void
Fill(uint32_t c, Ptr<Socket> s, uint32_t)
{
    Conn& k = g_conns[c];
    while (k.written_flows < k.order.size())
    {
        // the next flow in turn with bytes left (one exists: not every started flow is written)
        while (g_flows[k.order[k.turn % k.order.size()]].sent == g_flows[k.order[k.turn % k.order.size()]].bytes)
        {
            ++k.turn;
        }
        k.turn %= k.order.size();
        Flow& f = g_flows[k.order[k.turn]];
        uint32_t room = s->GetTxAvailable();
        if (room == 0)
        {
            return; // called again when the buffer drains
        }
        // alone on its connection a flow goes in large writes; shared, in turns, at most
        // a slice ahead of what TCP has sent (called again as ACKs free the buffer)
        if (k.flows > 1 && Unsent(k) >= kSlice)
        {
            return;
        }
        uint64_t most = k.flows == 1 ? kChunk : kSlice;
        uint32_t n = static_cast<uint32_t>(std::min<uint64_t>({room, f.bytes - f.sent, most}));
        int r = s->Send(Create<Packet>(n));
        if (r <= 0)
        {
            return;
        }
        f.sent += r;
        k.written += r;
        if (f.sent == f.bytes)
        {
            f.stream_end = k.written;
            ++k.written_flows;
        }
        ++k.turn;
    }
    if (k.written_flows == k.flows)
    {
        s->SetSendCallback(MakeNullCallback<void, Ptr<Socket>, uint32_t>());
        s->Close(); // the FIN follows the queued data
    }
}

void
Connected(uint32_t c, Ptr<Socket> s)
{
    g_conns[c].connected = true;
    Fill(c, s, s->GetTxAvailable());
}

// a connection ns-3's TCP gave up on (its SYN or its data unanswered after every
// retry): its flows will not finish, which the caller reports with this count
void
Failed(Ptr<Socket>)
{
    ++g_failed;
}

void
StartFlow(uint32_t i)
{
    Flow& f = g_flows[i];
    uint32_t c = g_conn_of[i];
    Conn& k = g_conns[c];
    if (k.socket && k.done == k.order.size() && Simulator::Now().GetSeconds() - k.idle_since >= g_min_rto_s)
    {
        // idle past the RTO: the next flow goes on a new connection
        k.socket->SetSendCallback(MakeNullCallback<void, Ptr<Socket>, uint32_t>());
        k.socket->Close();
        Conn next;
        next.flows = k.flows - static_cast<uint32_t>(k.order.size());
        k = next;
    }
    k.order.push_back(i);
    if (k.socket)
    {
        if (k.connected)
        {
            Fill(c, k.socket, k.socket->GetTxAvailable());
        }
        return; // a flow behind others on its connection: written when they are
    }
    uint32_t spine = f.spine < 0 ? 0 : f.spine;
    Ptr<Socket> s = Socket::CreateSocket(g_hosts.Get(f.src), TcpSocketFactory::GetTypeId());
    k.socket = s;
    s->Bind(InetSocketAddress(DataAddress(spine, f.src), 0));
    s->SetSendCallback(MakeBoundCallback(&Fill, c));
    // the highest byte sent, not the next to send: that one moves back to a lost segment
    // on a retransmission, and sent bytes would count as unsent until the ACK caught up
    NS_ABORT_MSG_UNLESS(s->TraceConnectWithoutContext("HighestSequence", MakeBoundCallback(&HighTx, c, PeekPointer(s))),
                        "no HighestSequence trace source on the TCP socket");
    s->SetConnectCallback(MakeBoundCallback(&Connected, c), MakeCallback(&Failed));
    s->SetCloseCallbacks(MakeNullCallback<void, Ptr<Socket>>(), MakeCallback(&Failed));
    s->Connect(InetSocketAddress(DataAddress(spine, f.dst), kPort));
    // keyed by the address the connection really uses (set by Connect's route lookup)
    Address name;
    s->GetSockName(name);
    InetSocketAddress local = InetSocketAddress::ConvertFrom(name);
    g_by_source[{local.GetIpv4().Get(), local.GetPort()}] = c;
}

void
OnRx(Ptr<const Packet> p, const Address& from, const Address&)
{
    InetSocketAddress a = InetSocketAddress::ConvertFrom(from);
    auto it = g_by_source.find({a.GetIpv4().Get(), a.GetPort()});
    if (it == g_by_source.end())
    {
        return;
    }
    Conn& k = g_conns[it->second];
    k.rcvd += p->GetSize();
    // a connection's flows are done in the order they started, each once its last byte is in
    while (k.done < k.order.size() && k.rcvd >= g_flows[k.order[k.done]].stream_end)
    {
        Flow& f = g_flows[k.order[k.done]];
        ++k.done;
        k.idle_since = Simulator::Now().GetSeconds();
        f.end = Simulator::Now().GetSeconds();
        ++g_done;
        uint32_t pct = static_cast<uint32_t>(100.0 * g_done / g_flows.size());
        if (pct > g_reported || g_done == g_flows.size())
        {
            g_reported = pct;
            std::fprintf(stderr, "progress %u %zu\n", g_done, g_flows.size());
            std::fflush(stderr);
        }
        if (g_done == g_flows.size())
        {
            Simulator::Stop(); // the remaining events are FIN/ACK exchanges
        }
    }
}

uint32_t
AddInterface(Ptr<Node> node, Ptr<NetDevice> dev, Ipv4Address addr, Ipv4Mask mask = Ipv4Mask("255.255.255.255"))
{
    Ptr<Ipv4> ip = node->GetObject<Ipv4>();
    int32_t k = ip->AddInterface(dev);
    ip->AddAddress(k, Ipv4InterfaceAddress(addr, mask));
    ip->SetUp(k);
    return k;
}

Ptr<Ipv4StaticRouting>
Static(Ptr<Node> node)
{
    Ipv4StaticRoutingHelper h;
    return h.GetStaticRouting(node->GetObject<Ipv4>());
}

} // namespace

int
main(int argc, char* argv[])
{
    uint32_t leaves = 2, spines = 2, hpl = 2, mtu = 9000;
    double host_gbps = 100, spine_gbps = 100, delay_us = 1, horizon_s = 3600, min_rto_ms = 5;
    uint64_t queue_bytes = 16 << 20, buf_bytes = 1 << 20, burst_bytes = 0;
    double line_x = 100;
    bool lossless_host = true, fair_host = true;
    std::string tcp = "TcpCubic", flows_file, out_file;
    CommandLine cmd(__FILE__);
    cmd.AddValue("leaves", "leaves", leaves);
    cmd.AddValue("spines", "spines", spines);
    cmd.AddValue("hostsPerLeaf", "hosts per leaf", hpl);
    cmd.AddValue("hostGbps", "host link rate (Gbit/s)", host_gbps);
    cmd.AddValue("spineGbps", "leaf-spine link rate (Gbit/s)", spine_gbps);
    cmd.AddValue("mtu", "link MTU (bytes); the TCP segment is MTU - 52", mtu);
    cmd.AddValue("delayUs", "propagation delay per link (us)", delay_us);
    cmd.AddValue("queueBytes", "FIFO buffer per egress port (bytes), drop-tail", queue_bytes);
    cmd.AddValue("burstBytes", "token bucket per egress port (bytes); 0: a plain FIFO buffer", burst_bytes);
    cmd.AddValue("lineX", "with a token bucket, the device rate over the link rate", line_x);
    cmd.AddValue("bufBytes", "TCP send and receive buffers (bytes)", buf_bytes);
    cmd.AddValue("losslessHost", "a host's own egress port holds all its sockets can send (1) or queueBytes (0)",
                 lossless_host);
    cmd.AddValue("fairHost", "a host's own egress port serves its connections in turn (1) or first come (0)",
                 fair_host);
    cmd.AddValue("minRtoMs", "TCP minimum RTO (ms)", min_rto_ms);
    cmd.AddValue("tcp", "TCP congestion control (ns-3 type name without ns3::)", tcp);
    cmd.AddValue("horizonS", "stop this long after the last flow start (s)", horizon_s);
    cmd.AddValue("flows", "input: id src dst spine bytes start_s per line", flows_file);
    cmd.AddValue("out", "output: id fct_s per line", out_file);
    cmd.Parse(argc, argv);
    g_hpl = hpl;
    if (queue_bytes > kMaxQueue)
    {
        std::fprintf(stderr, "error: --queueBytes must be at most %llu (a queue disc's size is 32 bits)\n",
                     (unsigned long long)kMaxQueue);
        return 2;
    }
    if (burst_bytes > 0 && (burst_bytes <= mtu || line_x < 1))
    {
        std::fprintf(stderr, "error: --burstBytes must exceed --mtu (a packet must fit the bucket), --lineX >= 1\n");
        return 2;
    }

    std::ifstream in(flows_file);
    if (!in)
    {
        std::fprintf(stderr, "error: cannot read --flows %s\n", flows_file.c_str());
        return 2;
    }
    for (std::string line; std::getline(in, line);)
    {
        if (line.empty())
        {
            continue;
        }
        std::istringstream ls(line);
        Flow f;
        if (!(ls >> f.id >> f.src >> f.dst >> f.spine >> f.bytes >> f.start))
        {
            std::fprintf(stderr, "error: bad flow line: %s\n", line.c_str());
            return 2;
        }
        std::string conn, extra;
        if (ls >> conn)
        {
            // a conn field, if given, is a whole integer and the last field
            size_t used = 0;
            try
            {
                f.conn = std::stoll(conn, &used);
            }
            catch (const std::exception&)
            {
                used = 0;
            }
            if (used != conn.size() || (ls >> extra))
            {
                std::fprintf(stderr, "error: bad flow line: %s\n", line.c_str());
                return 2;
            }
        }
        if (f.bytes == 0)
        {
            std::fprintf(stderr, "error: flow %llu has no bytes\n", (unsigned long long)f.id);
            return 2;
        }
        g_flows.push_back(f);
    }
    std::map<std::tuple<int64_t, uint32_t, uint32_t, int32_t>, uint32_t> conn_index;
    for (const Flow& f : g_flows)
    {
        uint32_t c = static_cast<uint32_t>(g_conns.size());
        if (f.conn >= 0)
        {
            auto ins = conn_index.emplace(std::make_tuple(f.conn, f.src, f.dst, f.spine), c);
            c = ins.first->second;
        }
        if (c == g_conns.size())
        {
            g_conns.emplace_back();
        }
        ++g_conns[c].flows;
        g_conn_of.push_back(c);
    }

    Config::SetDefault("ns3::TcpL4Protocol::SocketType", StringValue("ns3::" + tcp));
    Config::SetDefault("ns3::TcpSocket::SegmentSize", UintegerValue(mtu - 52));
    Config::SetDefault("ns3::TcpSocket::SndBufSize", UintegerValue(buf_bytes));
    Config::SetDefault("ns3::TcpSocket::RcvBufSize", UintegerValue(buf_bytes));
    Config::SetDefault("ns3::TcpSocket::InitialCwnd", UintegerValue(10));
    // The SYN's timeout outlasts the path's worst queueing (four FIFO ports full, out and
    // back), and at least Linux's initial RTO (1 s). At 10 ms, a SYN queued behind a full
    // port was sent again and again; ns-3's listener forked a socket per duplicate SYN, and
    // the connection that the first SYN-ACK established never had its data acknowledged
    // (every retransmission unanswered until TCP gave up: its flows never finished).
    double queue_s = 4.0 * queue_bytes * 8 / (std::min(host_gbps, spine_gbps) * 1e9);
    Config::SetDefault("ns3::TcpSocket::ConnTimeout", TimeValue(Seconds(std::max(1.0, 2 * queue_s))));
    Config::SetDefault("ns3::TcpSocketBase::MinRto", TimeValue(MicroSeconds(min_rto_ms * 1000)));
    g_min_rto_s = min_rto_ms / 1000.0;
    // Every segment is acknowledged at once. With ns-3's delayed ACK (every second
    // segment, else after 200 ms) above the RTO floor, a connection whose window a
    // loss had cut to one segment sent each segment twice, the second after an RTO,
    // and never grew its window: a 2.3 MB push took 7.2 s against 0.56 s measured.
    // Linux's floor (200 ms) is above its delayed ACK (40 ms at first), so it has no
    // such trap; ns-3's floor here is milliseconds (auto_min_rto_ms).
    Config::SetDefault("ns3::TcpSocket::DelAckCount", UintegerValue(1));
    Config::SetDefault("ns3::TcpSocketBase::ClockGranularity", TimeValue(MicroSeconds(100)));

    uint32_t n_hosts = leaves * hpl;
    g_hosts.Create(n_hosts);
    NodeContainer leaf_nodes, spine_nodes;
    leaf_nodes.Create(leaves);
    spine_nodes.Create(spines);
    InternetStackHelper stack;
    Ipv4StaticRoutingHelper static_routing;
    stack.SetRoutingHelper(static_routing); // static only: no global routing tables
    stack.Install(g_hosts);
    stack.Install(leaf_nodes);
    stack.Install(spine_nodes);

    auto gbps_rate = [](double gbps) {
        std::ostringstream rate;
        rate << gbps << "Gbps";
        return rate.str();
    };
    auto link = [&](double gbps) {
        PointToPointHelper p;
        std::string rate = gbps_rate(burst_bytes > 0 ? gbps * line_x : gbps);
        p.SetDeviceAttribute("DataRate", StringValue(rate));
        p.SetDeviceAttribute("Mtu", UintegerValue(mtu));
        p.SetChannelAttribute("Delay", TimeValue(NanoSeconds(delay_us * 1000)));
        // the port's buffer is the FIFO queue disc installed below; the device holds one
        // packet, so the queue disc is where packets wait and are dropped (and counted)
        p.SetQueue("ns3::DropTailQueue", "MaxSize", StringValue("1p"));
        return p;
    };
    auto port_buffer = [&](double gbps, uint64_t bytes, bool fair = false) {
        TrafficControlHelper t;
        QueueSizeValue size(QueueSize(QueueSizeUnit::BYTES, bytes));
        // fair: one queue per connection served in turn (FQ-CoDel with CoDel's dropping
        // out of reach), else one FIFO
        const char* fifo = fair ? "ns3::FqCoDelQueueDisc" : "ns3::FifoQueueDisc";
        auto fifo_attrs = [&](auto&& set) {
            if (fair)
            {
                // FQ-CoDel counts packets: a lossless port as many as its bytes (it never drops
                // before the FIFO of bytes would), else as many full-size packets as its bytes,
                // one packet dropped at a time (FQ-CoDel's default is up to 64 from the fattest
                // flow); 65536 flow queues, made as used, so connections hardly ever share one
                uint64_t packets = lossless_host ? bytes : std::max<uint64_t>(1, bytes / mtu);
                set(fifo, "MaxSize", QueueSizeValue(QueueSize(QueueSizeUnit::PACKETS, packets)), "Interval",
                    StringValue("100s"), "Target", StringValue("10s"), "DropBatchSize", UintegerValue(1),
                    "Flows", UintegerValue(65536));
            }
            else
            {
                set(fifo, "MaxSize", size);
            }
        };
        if (burst_bytes > 0)
        {
            uint16_t root = t.SetRootQueueDisc("ns3::TbfQueueDisc",
                                               "MaxSize", size,
                                               "Burst", UintegerValue(burst_bytes),
                                               "Mtu", UintegerValue(mtu),
                                               "Rate", DataRateValue(DataRate(gbps_rate(gbps))));
            if (fair)
            {
                auto cls = t.AddQueueDiscClasses(root, 1, "ns3::QueueDiscClass");
                fifo_attrs([&](auto&&... a) { t.AddChildQueueDisc(root, cls[0], a...); });
            }
        }
        else
        {
            fifo_attrs([&](auto&&... a) { t.SetRootQueueDisc(a...); });
        }
        return t;
    };
    // A sender's own port does not drop (losslessHost, the default): Linux's TCP small
    // queues hold a socket's data in its send buffer while its bytes in the qdisc are
    // over about 1 ms of its rate, where ns-3's TCP sends its whole window into the
    // queue disc. The testbed dropped no packet at a host's port on any bridge-suite
    // run (1 MiB buffers); with 16 KiB buffers it does (tests/test_testbed_fabric.py),
    // and there this overstates the port. The queue holds every byte the host's
    // sockets' buffers can have sent and not yet had acknowledged.
    std::vector<uint64_t> host_conns(n_hosts, 0); // connections a host sends on
    {
        std::vector<int64_t> conn_src(g_conns.size(), -1);
        for (size_t i = 0; i < g_flows.size(); ++i)
        {
            conn_src[g_conn_of[i]] = g_flows[i].src;
        }
        for (int64_t src : conn_src)
        {
            if (src >= 0 && src < static_cast<int64_t>(n_hosts))
            {
                ++host_conns[src];
            }
        }
    }
    TrafficControlHelper host_buffer = port_buffer(host_gbps, queue_bytes), spine_buffer = port_buffer(spine_gbps, queue_bytes);
    auto install_buffer = [&](TrafficControlHelper& t, Ptr<NetDevice> dev, uint32_t tier) {
        QueueDiscContainer q = t.Install(dev);
        q.Get(0)->TraceConnectWithoutContext("Drop", MakeBoundCallback(&OnQueueDiscDrop, tier));
        // a fair queue under a token bucket cannot ask the device for its quantum
        Ptr<QueueDisc> fq = q.Get(0)->GetNQueueDiscClasses() ? q.Get(0)->GetQueueDiscClass(0)->GetQueueDisc() : q.Get(0);
        if (Ptr<FqCoDelQueueDisc> f = DynamicCast<FqCoDelQueueDisc>(fq))
        {
            f->SetQuantum(mtu);
        }
    };
    PointToPointHelper host_link = link(host_gbps), spine_link = link(spine_gbps);
    g_uplink_bytes.assign(leaves * spines, 0);
    uint32_t infra = 11u << 24; // switch interface addresses: unique /32s, never routed to

    for (uint32_t h = 0; h < n_hosts; ++h)
    {
        uint32_t l = h / hpl;
        NetDeviceContainer d = host_link.Install(g_hosts.Get(h), leaf_nodes.Get(l));
        uint64_t out_bytes = lossless_host ? std::max<uint64_t>(queue_bytes, host_conns[h] * buf_bytes) : queue_bytes;
        if (out_bytes > kMaxQueue)
        {
            // a queue disc's size is 32 bits: past it the port may drop after all
            std::fprintf(stderr, "stats host_queue_clamped %u %llu\n", h, (unsigned long long)out_bytes);
            out_bytes = kMaxQueue;
        }
        TrafficControlHelper host_out = port_buffer(host_gbps, out_bytes, fair_host);
        install_buffer(host_out, d.Get(0), kHostUp);
        install_buffer(host_buffer, d.Get(1), kLeafDown);
        Ptr<Ipv4> ip = g_hosts.Get(h)->GetObject<Ipv4>();
        // /16 masks: ns-3 takes a TCP connection's source address from the route's source
        // selection (not from Bind), which prefers the address in the destination's /16,
        // so a flow to a spine-s address leaves from this host's spine-s address
        uint32_t hk = AddInterface(g_hosts.Get(h), d.Get(0), DataAddress(0, h), Ipv4Mask("255.255.0.0"));
        for (uint32_t s = 1; s < spines; ++s)
        {
            ip->AddAddress(hk, Ipv4InterfaceAddress(DataAddress(s, h), Ipv4Mask("255.255.0.0")));
        }
        Static(g_hosts.Get(h))->AddNetworkRouteTo(Ipv4Address("0.0.0.0"), Ipv4Mask("0.0.0.0"), hk);
        uint32_t lk = AddInterface(leaf_nodes.Get(l), d.Get(1), Ipv4Address(infra++));
        for (uint32_t s = 0; s < spines; ++s)
        {
            Static(leaf_nodes.Get(l))->AddHostRouteTo(DataAddress(s, h), lk);
        }
    }
    for (uint32_t l = 0; l < leaves; ++l)
    {
        for (uint32_t s = 0; s < spines; ++s)
        {
            NetDeviceContainer d = spine_link.Install(leaf_nodes.Get(l), spine_nodes.Get(s));
            install_buffer(spine_buffer, d.Get(0), kLeafUp);
            install_buffer(spine_buffer, d.Get(1), kSpineDown);
            uint32_t up = AddInterface(leaf_nodes.Get(l), d.Get(0), Ipv4Address(infra++));
            d.Get(0)->TraceConnectWithoutContext("PhyTxEnd", MakeBoundCallback(&OnUplinkTx, l * spines + s));
            uint32_t down = AddInterface(spine_nodes.Get(s), d.Get(1), Ipv4Address(infra++));
            Static(leaf_nodes.Get(l))
                ->AddNetworkRouteTo(Ipv4Address((10u << 24) | ((s + 1) << 16)), Ipv4Mask("255.255.0.0"), up);
            Static(spine_nodes.Get(s))
                ->AddNetworkRouteTo(Ipv4Address((10u << 24) | ((s + 1) << 16) | (l << 8)),
                                    Ipv4Mask("255.255.255.0"),
                                    down);
        }
    }

    // a device queue that overflows despite the queue disc in front would drop here
    for (NodeList::Iterator it = NodeList::Begin(); it != NodeList::End(); ++it)
    {
        for (uint32_t k = 0; k < (*it)->GetNDevices(); ++k)
        {
            Ptr<PointToPointNetDevice> dev = DynamicCast<PointToPointNetDevice>((*it)->GetDevice(k));
            if (dev)
            {
                dev->GetQueue()->TraceConnectWithoutContext("Drop", MakeCallback(&OnDrop));
            }
        }
    }

    std::vector<bool> receives(n_hosts, false);
    double last_start = 0;
    for (uint32_t i = 0; i < g_flows.size(); ++i)
    {
        const Flow& f = g_flows[i];
        if (f.src >= n_hosts || f.dst >= n_hosts || f.spine >= static_cast<int32_t>(spines))
        {
            std::fprintf(stderr, "error: flow %llu: host or spine out of range\n", (unsigned long long)f.id);
            return 2;
        }
        receives[f.dst] = true;
        last_start = std::max(last_start, f.start);
        Simulator::Schedule(Seconds(f.start), &StartFlow, i);
    }
    for (uint32_t h = 0; h < n_hosts; ++h)
    {
        if (!receives[h])
        {
            continue;
        }
        PacketSinkHelper sink("ns3::TcpSocketFactory", InetSocketAddress(Ipv4Address::GetAny(), kPort));
        ApplicationContainer app = sink.Install(g_hosts.Get(h));
        app.Start(Seconds(0));
        app.Get(0)->TraceConnectWithoutContext("RxWithAddresses", MakeCallback(&OnRx));
    }

    Simulator::Stop(Seconds(last_start + horizon_s));
    Simulator::Run();
    std::ofstream out(out_file);
    out.precision(12);
    for (const Flow& f : g_flows)
    {
        out << f.id << ' ' << (f.end < 0 ? -1.0 : f.end - f.start) << '\n';
    }
    std::fprintf(stderr, "stats drops %llu\n", (unsigned long long)g_drops);
    std::fprintf(stderr, "stats conn_failed %llu\n", (unsigned long long)g_failed);
    for (uint32_t k = 0; k < kTiers; ++k)
    {
        std::fprintf(stderr, "stats tier_drops %s %llu\n", kTierNames[k], (unsigned long long)g_tier_drops[k]);
    }
    for (uint32_t k = 0; k < g_uplink_bytes.size(); ++k)
    {
        if (g_uplink_bytes[k])
        {
            std::fprintf(stderr, "stats uplink %u %u %llu\n", k / spines, k % spines,
                         (unsigned long long)g_uplink_bytes[k]);
        }
    }
    Simulator::Destroy();
    return 0;
}
