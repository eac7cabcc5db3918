%% What each scenario is: the seed it reproduces, its parameters (per size: `tiny'
%% for tests and smoke runs, `normal' otherwise), the points it measures, the
%% figures it reports, which figures are compared with the baseline, and the figure
%% `tune' optimises, and each point's deadline. Pure data; the measuring is in
%% `convoy_bench_measure'.
%%
%% `ceiling' (default false): the scenario also runs the `ceiling' variant
%% (`convoy_bench_ceiling') and its table shows convoy as a fraction of it.
%% `handover' (default false): the same for the `handover' variant
%% (`convoy_bench_handover', each message handed to a bare batching process).
%% `send_many' (default false): the scenario also runs the `send_many' variant
%% (convoy, the sender handing its messages over in lists: `convoy:send_many/1').
%% `batch' (default false): the scenario also runs the `batch' variant (convoy,
%% the convoy variants' sends inside `convoy:batch/1': a stream's in scopes of
%% `max_batch' sends, every other send in a scope of its own).
%% `manifold' (default false): the scenario also runs the `manifold' variant
%% (discord/manifold's `Manifold.send/2', where convoy sends with
%% `convoy:multicast/2').
%% `pubsub' (default false): the scenario measures Phoenix.PubSub's adapters, so
%% it runs the `pg2' variant (the baseline) and the convoy ones, and no other.
%%
%% `large' is one sender's stream of a large message that an application sends
%% (`{msg, {big, Bin}}', encoded just over `large_threshold') to a process with
%% a default mailbox, where `sizes' sends bare binaries to an `off_heap' sink.
%%
%% `oneway', `oneway8', `flood' and `pairs' measure two message shapes, named in the point
%% label: the scenario's small message (`atom' = the atom `message'; `ping' = the
%% seed's `{ping, Pid}'; `req' = `{req, Pid, Payload}') and `event', a realistic
%% one: `{event, Id, <<"user-42">>, #{k => Id}}' with Id the message's sequence
%% number (in `pairs' the request is `{req, Pid, Event}' with the payload in the
%% map: `#{k => Id, body => Payload}'). `oneway' and `oneway8' measure a third,
%% `phoenix': a map as a Phoenix.PubSub broadcast of a channel message carries
%% (ten binary keys, a payload map of string keys, about 420 bytes encoded, the
%% sequence number inside; `convoy_bench_measure:message/2').
-module(convoy_bench_scenarios).

-export([names/0, default_selection/0, spec/3, param_keys/1, apart/1]).

-type size() :: tiny | normal.
-type unit() :: rate | us | ms | ns | mbs | count | bytes | number.
-type point() :: #{label := binary(), params := map()}.
-type spec() :: #{name := atom(),
                  title := binary(),
                  placement := cross | same_node,
                  sinks := pos_integer(),
                  params := map(),
                  points := [point(), ...],
                  figures := [{atom(), binary(), unit()}],
                  ratio := [atom()],
                  %% figures only some variants measure (publish: the plain ways)
                  optional => [atom()],
                  primary := {atom(), higher | lower},
                  convoy := measured | {awaiting, binary()},
                  ceiling := boolean(),
                  handover := boolean(),
                  send_many := boolean(),
                  batch := boolean(),
                  manifold := boolean(),
                  pubsub := boolean(),
                  timeout := pos_integer(),
                  deadline := pos_integer()}.
-export_type([spec/0, size/0, unit/0, point/0]).

%% `sizes' on a capped link (`at_rate/3'): seconds of the link per point, and the
%% fewest messages of a size.
-define(SIZES_LINK_SECONDS, 2).
-define(SIZES_LINK_MIN, 10).

%% @doc Every scenario, in report order.
-spec names() -> [atom()].
names() ->
    [local, flood, oneway, oneway8, sizes, large, pairs, latency, cast, call, bulk, hol, fanout,
     publish, pubsub, flow, mesh].

%% @doc What `make bench' runs without arguments.
-spec default_selection() -> [atom()].
default_selection() ->
    [local, flood, oneway, latency].

%% @doc Integer parameters of a scenario that `--param key=value' may override
%% (`deadline_ms' belongs to every scenario).
-spec param_keys(atom()) -> [atom()].
param_keys(Name) ->
    [K || {K, V} <- maps:to_list(params(Name, normal)), is_integer(V)] ++ [deadline_ms].

%% @doc The scenario `Name' at `Size', with `Overrides' applied to its parameters
%% (unknown keys are ignored: they may belong to another scenario).
-spec spec(atom(), size(), map()) -> spec().
spec(Name, Size, Overrides) ->
    P0 = params(Name, Size),
    P = maps:merge(P0, maps:with(maps:keys(P0), maps:merge(at_rate(Name, P0, Overrides),
                                                             Overrides))),
    Deadline = maps:get(deadline_ms, Overrides, deadline(Name, Size)),
    Limits = #{ceiling => false, handover => false, send_many => false, batch => false,
               manifold => false, pubsub => false},
    (maps:merge(Limits, describe(Name, P)))#{name => Name, params => P,
                                             timeout => case Size of
                                                            tiny -> 30000;
                                                            normal -> 300000
                                                        end,
                                             deadline => Deadline}.

%% On a link capped at `link_rate' (bytes/s, `--netns --rate'): the bytes a
%% `sizes' point sends are what the link carries in ?SIZES_LINK_SECONDS (at most
%% the normal budget), and a size may send as few as ?SIZES_LINK_MIN of its
%% messages, so the scenario fits in a few minutes at that rate; parameters given
%% with `--param' still win.
at_rate(sizes, #{budget := Budget}, #{link_rate := BytesPerSec}) ->
    #{budget => max(1, min(Budget, BytesPerSec * ?SIZES_LINK_SECONDS)),
      min_count => ?SIZES_LINK_MIN};
at_rate(_Name, _Params, _Overrides) ->
    #{}.

%% How long one point may take, set-up and clean-up included, before it is
%% reported as FAILED (`deadline N ms') and its nodes are replaced: a few times the
%% point's usual duration at `normal' size on 2 cores (in brackets), generous
%% enough for a loaded machine; `--param deadline_ms=N' overrides it.
deadline(_Name, tiny) -> 20000;
deadline(local, normal) -> 60000;     % 2 M one-way + 300 k ping-pong (~5 s)
deadline(flood, normal) -> 60000;     % 200 k pingers (~2-10 s)
deadline(oneway, normal) -> 30000;    % 1 M messages (~0.5-3 s)
deadline(oneway8, normal) -> 30000;   % 1 M messages (~0.5-3 s)
deadline(sizes, normal) -> 30000;     % up to 3 GB or 300 k messages (~0.7-3 s)
deadline(large, normal) -> 30000;     % 15 k messages of 64 KiB, 1 GB (~0.2-1 s)
deadline(pairs, normal) -> 20000;     % 1.2 s window, up to 1024 pairs spawned
deadline(latency, normal) -> 30000;   % 20 k sequential round trips (~1-3 s)
deadline(cast, normal) -> 30000;      % 320 k casts (~1-5 s)
deadline(call, normal) -> 20000;      % 1.2 s window, up to 256 callers spawned
deadline(bulk, normal) -> 20000;      % 1.8 s window
deadline(hol, normal) -> 20000;       % 2.3 s window
deadline(fanout, normal) -> 60000;    % 21 rounds to 10 k processes (~1-3 s); 100
                                      % senders: 3 rounds of 1 M deliveries (~3-15 s);
                                      % 100 senders x own 100: 21 rounds of 10 k
deadline(publish, normal) -> 120000;  % as fanout, twice for plain modes (two ways)
deadline(pubsub, normal) -> 30000;    % 1.2 s window, up to 256 publishers, 20 subscribers
deadline(flow, normal) -> 60000;      % 100 k slow items, syncing (~2-10 s)
deadline(mesh, normal) -> 60000.      % up to 30 pairs x 20 k messages (~1-10 s)

params(local, normal) -> #{n_oneway => 2000000, n_pingpong => 300000};
params(local, tiny) -> #{n_oneway => 20000, n_pingpong => 2000};
params(flood, normal) -> #{pingers => 200000};
params(flood, tiny) -> #{pingers => 2000};
params(oneway, normal) -> #{n => 1000000};
params(oneway, tiny) -> #{n => 10000};
params(oneway8, normal) -> #{n => 1000000, senders => 8};
params(oneway8, tiny) -> #{n => 10000, senders => 8};
params(sizes, normal) -> #{sizes => [16, 128, 1024, 8192, 65536, 1048576],
                           budget => 3000000000, min_count => 1000, max_count => 300000};
params(sizes, tiny) -> #{sizes => [16, 1024, 65536, 1048576],
                         budget => 4000000, min_count => 10, max_count => 3000};
params(large, normal) -> #{n => 15000, size => 65536, off_heap => 0};
params(large, tiny) -> #{n => 300, size => 65536, off_heap => 0};
params(pairs, normal) -> #{pairs => [1, 4, 16, 64, 256, 1024], event_pairs => [1, 4, 64, 256],
                           paced_pairs => [16, 64], pace_ms => 1,
                           payload => 1024, duration_ms => 1000, warmup_ms => 200};
params(pairs, tiny) -> #{pairs => [1, 8], event_pairs => [8], paced_pairs => [8], pace_ms => 1,
                         payload => 1024, duration_ms => 100, warmup_ms => 20};
params(latency, normal) -> #{n => 20000, warmup => 2000, burst => 10000};
params(latency, tiny) -> #{n => 300, warmup => 30, burst => 300};
params(cast, normal) -> #{senders => 64, per_sender => 5000};
params(cast, tiny) -> #{senders => 64, per_sender => 20};
params(call, normal) -> #{callers => [1, 16, 256], duration_ms => 1000, warmup_ms => 200};
params(call, tiny) -> #{callers => [1, 16], duration_ms => 100, warmup_ms => 20};
params(bulk, normal) -> #{senders => [1, 16], size => 10000000,
                          duration_ms => 1500, warmup_ms => 300};
params(bulk, tiny) -> #{senders => [1, 4], size => 200000,
                        duration_ms => 100, warmup_ms => 20};
params(hol, normal) -> #{bulk_senders => 4, size => 10000000, probe_ms => 10,
                         duration_ms => 2000, warmup_ms => 300};
params(hol, tiny) -> #{bulk_senders => 2, size => 200000, probe_ms => 2,
                       duration_ms => 150, warmup_ms => 20};
params(fanout, normal) -> #{receivers => 10000, rounds => 20, senders => [1, 100], own => [100]};
params(fanout, tiny) -> #{receivers => 200, rounds => 3, senders => [1, 10], own => [10]};
params(publish, normal) -> #{members => 10000, rounds => 20, senders => [1, 100]};
params(publish, tiny) -> #{members => 200, rounds => 3, senders => [1, 10]};
params(pubsub, normal) -> #{subscribers => 10, publishers => [1, 16, 256], duration_ms => 1000,
                            warmup_ms => 200};
params(pubsub, tiny) -> #{subscribers => 3, publishers => [1, 16], duration_ms => 100,
                          warmup_ms => 20};
params(flow, normal) -> #{n => 100000, work => 250, every => 1000, window => 1000,
                          ack_every => 0};
params(flow, tiny) -> #{n => 5000, work => 250, every => 1000, window => 1000,
                        ack_every => 0};
params(mesh, normal) -> #{nodes => [2, 4, 6], per_pair => 20000};
params(mesh, tiny) -> #{nodes => [2, 3], per_pair => 500}.

describe(local, P) ->
    #{title => <<"seed 002: same-node oneway and ping-pong (one process pair)">>,
      placement => same_node, sinks => 1,
      points => [point(<<"same node">>, P)],
      figures => [{oneway_msg_s, <<"oneway msg/s">>, rate},
                  {pingpong_rt_s, <<"ping-pong rt/s">>, rate}],
      ratio => [oneway_msg_s, pingpong_rt_s],
      primary => {oneway_msg_s, higher}, convoy => measured};
describe(flood, P = #{pingers := N}) ->
    #{title => fmt("seeds 000/001 (flood1): ~b spawned pingers, one registered pong; "
                   "pongs received per minute; ping: the seed's {ping, Pid}, event: "
                   "{event, Id, <<\"user-42\">>, #{k => Id}}; ns/msg: wall time per "
                   "pong, first spawn to last pong", [N]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b pingers, ~s", [N, Shape]), P#{shape => Shape})
                 || Shape <- [ping, event]],
      figures => [{msg_min, <<"msg/min">>, rate}, {ns_msg, <<"ns/msg">>, ns}],
      ratio => [msg_min], primary => {msg_min, higher}, convoy => measured, ceiling => true,
      handover => true};
describe(oneway, P = #{n := N}) ->
    #{title => fmt("one sender, ~b messages to one remote process; atom: the atom "
                   "'message', event: {event, Id, <<\"user-42\">>, #{k => Id}}, phoenix: "
                   "a Phoenix.PubSub broadcast's map of ten binary keys (~~420 bytes); "
                   "ns/msg: the sender's wall time per message", [N]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b msgs, ~s", [N, Shape]), P#{shape => Shape})
                 || Shape <- [atom, event, phoenix]],
      figures => [{msg_s, <<"msg/s">>, rate}, {ns_msg, <<"ns/msg">>, ns}],
      ratio => [msg_s], primary => {msg_s, higher}, convoy => measured, ceiling => true,
      handover => true, send_many => true, batch => true};
describe(oneway8, P = #{n := N, senders := K}) ->
    #{title => fmt("~b senders at once, each ~b messages to its own process on the other "
                   "node; atom, event and phoenix as in oneway; ns/msg: wall time per "
                   "message, all senders together", [K, N div K]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b x ~b msgs, ~s", [K, N div K, Shape]), P#{shape => Shape})
                 || Shape <- [atom, event, phoenix]],
      figures => [{msg_s, <<"msg/s">>, rate}, {ns_msg, <<"ns/msg">>, ns}],
      ratio => [msg_s], primary => {msg_s, higher}, convoy => measured, ceiling => true,
      handover => true, send_many => true, batch => true};
describe(sizes, #{sizes := Sizes, budget := Budget, min_count := Min,
                      max_count := Max}) ->
    #{title => <<"one sender, one-way, binary payloads of each size (MB = 10^6 bytes)">>,
      placement => cross, sinks => 1,
      points => [point(size_label(S), #{size => S,
                                        count => max(Min, min(Max, Budget div S))})
                 || S <- Sizes],
      figures => [{msg_s, <<"msg/s">>, rate}, {mb_s, <<"MB/s">>, mbs}],
      ratio => [mb_s], primary => {mb_s, higher}, convoy => measured, ceiling => true};
describe(large, P = #{n := N, size := Size, off_heap := OffHeap}) ->
    Mailbox = case OffHeap of
                  0 -> <<"default mailbox">>;
                  _ -> <<"off_heap mailbox">>
              end,
    #{title => fmt("one sender, ~b messages {msg, {big, Bin}} (the same Bin of ~b bytes each "
                   "time, encoded just over the default large_threshold) to one process on "
                   "the other node, ~s (--param off_heap=1: message_queue_data off_heap, as "
                   "the sink of sizes); MB/s counts Bin's bytes", [N, Size, Mailbox]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b msgs, {msg, {big, ~s}}, ~s", [N, size_label(Size), Mailbox]),
                       P)],
      figures => [{msg_s, <<"msg/s">>, rate}, {mb_s, <<"MB/s">>, mbs}],
      ratio => [msg_s], primary => {msg_s, higher}, convoy => measured};
describe(pairs, P = #{pairs := Pairs, event_pairs := EventPairs, paced_pairs := PacedPairs,
                       pace_ms := Pace}) ->
    Base = maps:without([pairs, event_pairs, paced_pairs, pace_ms], P),
    #{title => fmt("concurrent request/response pairs, ~b B requests, closed loop, ~b ms; "
                   "req: {req, Pid, Payload}, event: {req, Pid, {event, Id, "
                   "<<\"user-42\">>, #{k => Id, body => Payload}}}; \"~s\": each "
                   "client waits a random 0 to ~b ms (~b ms on average) after each answer "
                   "(many senders at a moderate rate, their timers out of step)",
                   [maps:get(payload, P), maps:get(duration_ms, P), apart(Pace), 2 * Pace,
                    Pace]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b pairs, ~s", [C, Shape]),
                       Base#{pairs => C, shape => Shape, pace_ms => 0})
                 || C <- lists:usort(Pairs ++ EventPairs),
                    Shape <- [req || lists:member(C, Pairs)]
                        ++ [event || lists:member(C, EventPairs)]]
          ++ [point(fmt("~b pairs, event, ~s", [C, apart(Pace)]),
                    Base#{pairs => C, shape => event, pace_ms => Pace})
              || Pace > 0, C <- PacedPairs],
      figures => [{rt_s, <<"rt/s">>, rate}, {p50_us, <<"p50">>, us},
                  {p99_us, <<"p99">>, us}, {p999_us, <<"p99.9">>, us}],
      ratio => [rt_s, p50_us, p99_us], primary => {rt_s, higher}, convoy => measured,
      batch => true};
describe(latency, P = #{n := N, burst := B}) ->
    #{title => fmt("idle round trip, one client, ~b sequential small round trips; "
                   "\"after burst\": the client first sends ~b one-way messages, "
                   "waits for one round trip and 5 ms", [N, B]),
      placement => cross, sinks => 1,
      points => [point(<<"idle">>, P#{burst => 0}), point(<<"after burst">>, P)],
      figures => [{p50_us, <<"p50">>, us}, {p99_us, <<"p99">>, us},
                  {p999_us, <<"p99.9">>, us}, {max_us, <<"max">>, us}],
      ratio => [p50_us, p99_us], primary => {p50_us, lower}, convoy => measured,
      batch => true};
describe(cast, P = #{senders := K, per_sender := N}) ->
    #{title => fmt("~b senders, ~b casts each to one gen_server on another node: "
                   "gen_server:cast (convoy variants: convoy:cast; handover: the cast's "
                   "message handed over); the request is "
                   "{event, Id, <<\"user-42\">>, #{k => Id}}; msg/s from the first cast "
                   "to the server's count of all of them", [K, N]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b senders, event", [K]), P)],
      figures => [{msg_s, <<"msg/s">>, rate}],
      ratio => [msg_s], primary => {msg_s, higher}, convoy => measured, handover => true};
describe(call, P = #{callers := Callers}) ->
    Base = maps:remove(callers, P),
    #{title => fmt("concurrent callers of one gen_server on another node, closed loop, "
                   "~b ms: gen_server:call (convoy variants: convoy:call); the request is "
                   "{event, Id, <<\"user-42\">>, #{k => Id}}, the reply ok",
                   [maps:get(duration_ms, P)]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b caller~s, event", [C, plural(C)]), Base#{callers => C})
                 || C <- Callers],
      figures => [{calls_s, <<"calls/s">>, rate}, {p50_us, <<"p50">>, us},
                  {p99_us, <<"p99">>, us}, {p999_us, <<"p99.9">>, us}],
      ratio => [calls_s, p50_us, p99_us], primary => {calls_s, higher}, convoy => measured};
describe(bulk, P = #{senders := Senders, size := Size}) ->
    Base = maps:remove(senders, P),
    #{title => fmt("seed 003: ~s binaries, each sender waits for its sink's answer",
                   [size_label(Size)]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b sender~s", [K, plural(K)]), Base#{senders => K})
                 || K <- Senders],
      figures => [{mb_s, <<"MB/s">>, mbs}],
      ratio => [mb_s], primary => {mb_s, higher}, convoy => measured};
describe(hol, P = #{bulk_senders := K, size := Size, probe_ms := Gap}) ->
    #{title => fmt("small round trips while ~b senders push ~s binaries to the same node; "
                   "\"bulk\": the bulk goes as the variant sends (convoy carries it), "
                   "\"bulk by !\": the bulk goes by plain ! from other code (what convoy "
                   "cannot pace) while the round trips use the variant; round trips back "
                   "to back (the faster they are, the more of them share the CPU with the "
                   "bulk), or ~b ms apart (\"paced\": about the same few in every variant)",
                   [K, size_label(Size), Gap]),
      placement => cross, sinks => 1,
      points => [point(fmt("~b bulk", [K]), P#{bulk_by => variant, probe_ms => 0}),
                 point(fmt("~b bulk, paced", [K]), P#{bulk_by => variant}),
                 point(fmt("~b bulk by !", [K]), P#{bulk_by => plain, probe_ms => 0})],
      figures => [{p50_us, <<"p50">>, us}, {p99_us, <<"p99">>, us},
                  {max_us, <<"max">>, us}, {rt_s, <<"rt/s">>, rate},
                  {bulk_mb_s, <<"bulk MB/s">>, mbs},
                  {sink_faults_mb, <<"B faults/MB">>, number}],
      %% the receiving node's minor page faults per MB of bulk (Linux's /proc)
      optional => [sink_faults_mb],
      ratio => [p50_us, p99_us, bulk_mb_s], primary => {p99_us, lower}, convoy => measured};
describe(fanout, P = #{receivers := R, senders := Senders, own := Own}) ->
    #{title => fmt("one message to ~b processes on two remote nodes: convoy:multicast "
                   "(convoy variants) vs Manifold.send (manifold) vs a loop of sends; from "
                   "one sender, from ~s concurrent senders each sending one per round "
                   "(fewer rounds: rounds div senders, at least 2), and from ~s concurrent "
                   "senders each to its own share of the processes, half on each node "
                   "(a round delivers ~b messages in all)",
                   [R, join([S || S <- Senders, S > 1]), join(Own), R]),
      placement => cross, sinks => 2,
      points => [point(case S of
                           1 -> fmt("~b procs", [R]);
                           _ -> fmt("~b procs, ~b senders", [R, S])
                       end, P#{senders => S, own => false})
                 || S <- Senders]
          ++ [point(fmt("~b procs, ~b senders x own ~b", [S * (R div S), S, R div S]),
                    P#{senders => S, own => true})
              || S <- Own],
      figures => [{round_ms, <<"ms/round">>, ms}, {deliveries_s, <<"deliveries/s">>, rate}],
      ratio => [deliveries_s], primary => {deliveries_s, higher}, convoy => measured,
      manifold => true};
describe(publish, P = #{members := M, senders := Senders}) ->
    #{title => fmt("a pg group of ~b members on two remote nodes, one message per "
                   "sender per round (rounds div senders, at least 2, with many): "
                   "convoy:publish (convoy variants) vs the better of two plain-OTP "
                   "ways (other variants): loop = `!' to each of pg:get_members, "
                   "dispatch = Phoenix.PubSub's way (one message per node to a "
                   "dispatcher there, which sends to pg:get_local_members); "
                   "deliveries/s counts messages received by members", [M]),
      placement => cross, sinks => 2,
      points => [point(fmt("~b members, ~b sender~s", [M, S, plural(S)]), P#{senders => S})
                 || S <- Senders],
      figures => [{round_ms, <<"ms/round">>, ms}, {deliveries_s, <<"deliveries/s">>, rate},
                  {loop_s, <<"loop deliveries/s">>, rate},
                  {dispatch_s, <<"dispatch deliveries/s">>, rate}],
      optional => [loop_s, dispatch_s],
      ratio => [deliveries_s], primary => {deliveries_s, higher}, convoy => measured};
describe(pubsub, P = #{subscribers := N, publishers := Pubs}) ->
    Base = maps:remove(publishers, P),
    #{title => fmt("Phoenix.PubSub, one topic: concurrent publishers on A, closed loop, ~b ms, "
                   "~b subscribers on each of B and C; Phoenix.PubSub.PG2 (pg2) vs "
                   "Phoenix.PubSub.Convoy (convoy variants) vs its sends handed to a bare "
                   "batching process (handover); each broadcast waits for one "
                   "subscriber per node to ack it (acks as the variant sends); bcast/s: "
                   "broadcasts acked by both nodes a second, deliveries/s: x ~b subscribers; "
                   "p50/p99: publish to delivery at the acking subscribers, "
                   "os:system_time of the one host",
                   [maps:get(duration_ms, P), N, 2 * N]),
      placement => cross, sinks => 2,
      points => [point(fmt("~b publisher~s", [K, plural(K)]), Base#{publishers => K})
                 || K <- Pubs],
      figures => [{bcast_s, <<"bcast/s">>, rate}, {deliveries_s, <<"deliveries/s">>, rate},
                  {p50_us, <<"p50">>, us}, {p99_us, <<"p99">>, us}],
      ratio => [bcast_s, p50_us, p99_us], primary => {bcast_s, higher}, convoy => measured,
      pubsub => true, handover => true};
describe(flow, P = #{n := N, every := Every, window := W, ack_every := A}) ->
    Modes = [{<<"flood">>, flood},
             {fmt("sync/~b", [Every]), sync},
             {case A of
                  0 -> fmt("channel W=~b", [W]);
                  _ -> fmt("channel W=~b/~b", [W, A])
              end, channel}],
    #{title => fmt("seed 004: ~b messages to a slow consumer (~b hashes each): flooding, "
                   "syncing every ~b, or a convoy_channel (window ~b, ack_every ~s); "
                   "consumer on the producer's node and on another node",
                   [N, maps:get(work, P), Every, W,
                    case A of 0 -> "window div 2"; _ -> integer_to_list(A) end]),
      placement => cross, sinks => 1,
      points => [point(iolist_to_binary([Label, ", ", WhereLabel]),
                       P#{mode => Mode, where => Where})
                 || {Label, Mode} <- Modes,
                    {WhereLabel, Where} <- [{<<"same node">>, same}, {<<"2 nodes">>, cross}]],
      figures => [{total_ms, <<"total ms">>, ms}, {producer_ms, <<"producer ms">>, ms},
                  {msg_s, <<"msg/s">>, rate}, {max_backlog, <<"peak queue">>, count},
                  {peak_mem, <<"peak consumer mem">>, bytes}],
      ratio => [msg_s], primary => {msg_s, higher}, convoy => measured};
describe(mesh, P = #{nodes := Counts, per_pair := M}) ->
    #{title => fmt("clusters of ~s nodes: on every node one sender per other node, each "
                   "~b event-shaped messages to a receiver there, all at once; msg/s in "
                   "all and per node", [join(Counts), M]),
      placement => cross, sinks => lists:max(Counts) - 1,
      %% (`where => cross': the local variant, on one node, has nothing to measure)
      points => [point(fmt("~b nodes", [N]), P#{nodes => N, where => cross}) || N <- Counts],
      figures => [{msg_s, <<"msg/s">>, rate}, {node_msg_s, <<"msg/s per node">>, rate}],
      ratio => [msg_s], primary => {msg_s, higher}, convoy => measured, handover => true}.

point(Label, Params) -> #{label => Label, params => Params}.

size_label(S) when S >= 1000000, S rem 1000000 =:= 0 -> fmt("~b MB", [S div 1000000]);
size_label(S) when S >= 1048576, S rem 1048576 =:= 0 -> fmt("~b MiB", [S div 1048576]);
size_label(S) when S >= 1024, S rem 1024 =:= 0 -> fmt("~b KiB", [S div 1024]);
size_label(S) when S >= 1000, S rem 1000 =:= 0 -> fmt("~b kB", [S div 1000]);
size_label(S) -> fmt("~b B", [S]).

join(Ns) -> lists:join(", ", [integer_to_list(N) || N <- Ns]).

plural(1) -> "";
plural(_) -> "s".

fmt(F, A) -> iolist_to_binary(io_lib:format(F, A)).

%% @doc How far apart a paced point's requests are, for its label and plots
%% (see `convoy_bench_measure:client/4').
-spec apart(pos_integer()) -> binary().
apart(MeanMs) -> fmt("0-~b ms apart", [2 * MeanMs]).
