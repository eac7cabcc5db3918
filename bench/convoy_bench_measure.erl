%% The measurements themselves. `run/3' executes on the driver node (peer A); the
%% processes it talks to are spawned on the sink nodes named in the context. Every
%% send in a measurement goes through `snd/3': `erlang:send/2' for the plain
%% variants, `convoy:send/2' for the convoy ones, on both sides of a round trip
%% (for the `batch' variant each inside its own `convoy:batch/1'),
%% for the `ceiling' variant a batching router without bookkeeping
%% (`convoy_bench_ceiling'; a sender of many messages batches them itself), and for
%% the `handover' variant each message handed to a bare batching process
%% (`convoy_bench_handover').
%%
%% Durations come from `erlang:monotonic_time/0'. Nothing here knows about
%% variants, repeats or reports: it returns the figures of one run as a map.
-module(convoy_bench_measure).

-export([run/3, run_for/4]).
%% Spawned on the nodes taking part.
-export([consumer/2, pong/3, pinger/4, server/1, spawn_servers/2, client/4,
         bulk_sink/1, bulk_sender/4, fault_meter/2]).
%% For the scenarios measured in modules of their own (convoy_bench_fanout,
%% convoy_bench_flow, convoy_bench_mesh).
-export([shaped/2, snd/3, sink/1, timeout/1, secs/1, await/2, send_all/4, finish/3]).
-export([gen_host/2, caster/5, caller/3]).

-type mode() :: plain | call | convoy | ceiling | handover | guarded | send_many | batch
                | pg2 | manifold.
-type ctx() :: #{mode := mode(), sinks := [node(), ...], timeout := pos_integer()}.
-type figures() :: #{atom() => number()}.
-export_type([ctx/0, figures/0, mode/0]).

-define(SINK_OPTS, [{message_queue_data, off_heap}]).
-define(PONG_NAME, convoy_bench_pong).

%% @doc One run of `Scenario' with `Params' (one point of the scenario).
-spec run(atom(), map(), ctx()) -> figures().
run(Scenario, Params, Ctx) ->
    process_flag(message_queue_data, off_heap),
    process_flag(priority, high),
    with_router(Ctx, fun() -> measure(Scenario, Params, Ctx) end).

%% The ceiling's and the handover's batchers and deliverers live as long as one
%% measurement.
with_router(#{mode := ceiling, sinks := Sinks}, Measure) ->
    with_router(convoy_bench_ceiling, [node() | Sinks], Measure);
with_router(#{mode := Mode, sinks := Sinks}, Measure) when Mode =:= handover;
                                                           Mode =:= guarded ->
    with_router(convoy_bench_handover, [node() | Sinks], Measure);
with_router(_Ctx, Measure) ->
    Measure().

with_router(Router, Nodes, Measure) ->
    ok = Router:start(Nodes),
    try
        Measure()
    after
        Router:stop(Nodes)
    end.

%% @doc `run/3' in a process of its own on the driver node, spawned by the harness
%% (which kills it at the point's deadline): sends `{Ref, {ok, Figures}}' or
%% `{Ref, {error, Class, Reason}}' to `Owner'.
-spec run_for(pid(), reference(), atom(), {map(), ctx()}) -> ok.
run_for(Owner, Ref, Scenario, {Params, Ctx}) ->
    Result = try run(Scenario, Params, Ctx) of
                 Figures -> {ok, Figures}
             catch
                 Class:Reason -> {error, Class, Reason}
             end,
    Owner ! {Ref, Result},
    ok.

%%--------------------------------------------------------------------
%% Scenarios

%% seed 002: oneway and ping-pong between two processes.
measure(local, #{n_oneway := N1, n_pingpong := N2}, Ctx) ->
    #{oneway_msg_s => element(1, oneway(Ctx, N1, atom)),
      pingpong_rt_s => pingpong_rate(Ctx, N2)};
%% seeds 000/001: N spawned pingers, one registered pong, pongs per minute.
%% `shape' ping: the seed's `{ping, Pid}'; event: see `message/2' (the pong
%% answers its owner, the driver, which is the collector anyway).
measure(flood, #{pingers := N, shape := Shape}, Ctx = #{mode := M}) ->
    Node = sink(Ctx),
    Pong = spawn_opt(Node, ?MODULE, pong, [M, ?PONG_NAME, self()], ?SINK_OPTS),
    await({registered, Pong}, Ctx),
    Dest = {?PONG_NAME, Node},
    Self = self(),
    T0 = erlang:monotonic_time(),
    spawn_pingers(N, M, Dest, {Shape, Self}),
    count(pong, N, Ctx),
    T1 = erlang:monotonic_time(),
    %% Gone before the next point registers its own pong under the same name.
    Mon = monitor(process, Pong),
    Pong ! stop,
    receive {'DOWN', Mon, process, Pong, _} -> ok
    after timeout(Ctx) -> exit({timeout, pong_stop})
    end,
    #{msg_min => N / (secs(T1 - T0) / 60), ns_msg => nanos(T1 - T0) / N};
measure(oneway, #{n := N, shape := Shape}, Ctx) ->
    {Rate, SenderNative} = oneway(Ctx, N, Shape),
    #{msg_s => Rate, ns_msg => nanos(SenderNative) / N};
%% K senders at once, each N div K messages to its own consumer on the sink node.
measure(oneway8, #{n := N, senders := K, shape := Shape}, Ctx = #{mode := M}) ->
    Per = N div K,
    Self = self(),
    Consumers = [spawn_opt(sink(Ctx), ?MODULE, consumer, [M, 0], ?SINK_OPTS)
                 || _ <- lists:seq(1, K)],
    Senders = [spawn_link(fun() ->
                                  receive go -> ok end,
                                  send_all(M, C, Shape, Per),
                                  finish(M, C, {done, Self})
                          end) || C <- Consumers],
    T0 = erlang:monotonic_time(),
    [S ! go || S <- Senders],
    Counts = [receive {done, C, Cnt} -> Cnt
              after timeout(Ctx) -> exit({timeout, oneway8_consumer})
              end || C <- Consumers],
    T1 = erlang:monotonic_time(),
    lists:sum(Counts) =:= Per * K orelse exit({lost, Per * K - lists:sum(Counts)}),
    #{msg_s => Per * K / secs(T1 - T0), ns_msg => nanos(T1 - T0) / (Per * K)};
measure(sizes, #{size := Size, count := N}, Ctx) ->
    {Rate, _} = oneway(Ctx, N, {data, binary:copy(<<"x">>, Size)}),
    #{msg_s => Rate, mb_s => Rate * Size / 1.0e6};
%% A large message an application sends, to a sink with a default mailbox unless
%% `off_heap' is set.
measure(large, #{n := N, size := Size, off_heap := OffHeap}, Ctx) ->
    Msg = {msg, {big, binary:copy(<<"x">>, Size)}},
    SinkOpts = case OffHeap of
                   0 -> [];
                   _ -> ?SINK_OPTS
               end,
    {Rate, _} = oneway(Ctx, N, {data, Msg}, SinkOpts),
    #{msg_s => Rate, mb_s => Rate * Size / 1.0e6};
measure(pairs, #{pairs := C, payload := Bytes, shape := Shape} = P, Ctx = #{mode := M}) ->
    Servers = erpc:call(sink(Ctx), ?MODULE, spawn_servers, [M, C]),
    Payload = binary:copy(<<"p">>, Bytes),
    What = case maps:get(pace_ms, P, 0) of
               0 -> {Shape, Payload};
               Pace -> {jittered, Pace, {Shape, Payload}}
           end,
    Clients = [spawn_link(?MODULE, client, [M, S, What, self()]) || S <- Servers],
    {Dur, Samples} = window(Clients, P, Ctx),
    stop_all(Servers),
    (latency_figures(Samples))#{rt_s => length(Samples) / Dur};
measure(latency, #{n := N, warmup := W, burst := B}, Ctx = #{mode := M}) ->
    [S] = erpc:call(sink(Ctx), ?MODULE, spawn_servers, [M, 1]),
    Req = {req, self(), ping},
    _ = round_trips(M, S, Req, W, []),
    %% A burst first (B > 0): then idle round trips by a sender that has just used
    %% convoy's batched path.
    after_burst(M, S, Req, B),
    T0 = erlang:monotonic_time(),
    Samples = round_trips(M, S, Req, N, []),
    T1 = erlang:monotonic_time(),
    stop_all([S]),
    (latency_figures(Samples))#{rt_s => N / secs(T1 - T0)};
%% K senders casting to one gen_server on the sink node, which counts them.
measure(cast, #{senders := K, per_sender := N}, Ctx = #{mode := M}) ->
    {Host, Server} = gen_on(sink(Ctx), K * N, Ctx),
    Senders = [spawn_link(?MODULE, caster, [M, Server, (I - 1) * N + 1, I * N, self()])
               || I <- lists:seq(1, K)],
    [await({caster_ready, S}, Ctx) || S <- Senders],
    T0 = erlang:monotonic_time(),
    [S ! go || S <- Senders],
    await({casts_done, Server}, Ctx),
    T1 = erlang:monotonic_time(),
    stop_all([Host]),
    #{msg_s => K * N / secs(T1 - T0)};
%% C closed-loop callers of one gen_server on the sink node.
measure(call, #{callers := C} = P, Ctx = #{mode := M}) ->
    {Host, Server} = gen_on(sink(Ctx), 0, Ctx),
    Callers = [spawn_link(?MODULE, caller, [M, Server, self()]) || _ <- lists:seq(1, C)],
    {Dur, Samples} = window(Callers, P, Ctx),
    stop_all([Host]),
    (latency_figures(Samples))#{calls_s => length(Samples) / Dur};
%% seed 003: 10 MB binaries, each sender waits for the sink's answer.
measure(bulk, #{senders := K, size := Size} = P, Ctx) ->
    {Sinks, Senders} = bulk_pairs(K, Size, Ctx),
    {Dur, Done} = window(Senders, P, Ctx),
    stop_all(Sinks),
    #{mb_s => length(Done) * Size / Dur / 1.0e6};
%% Small round trips while bulk senders push large binaries to the same node;
%% the bulk sent as the variant sends (`bulk_by' variant) or by plain `!'; the
%% round trips back to back, or `probe_ms' apart.
measure(hol, #{bulk_senders := K, size := Size, bulk_by := By} = P, Ctx = #{mode := M}) ->
    BulkCtx = case By of
                  variant -> Ctx;
                  plain -> Ctx#{mode := plain}
              end,
    {Sinks, Senders} = bulk_pairs(K, Size, BulkCtx),
    [S] = erpc:call(sink(Ctx), ?MODULE, spawn_servers, [M, 1]),
    Probe = {paced, maps:get(probe_ms, P, 0), {req, ping}},
    Prober = spawn_link(?MODULE, client, [M, S, Probe, self()]),
    Meter = spawn_link(?MODULE, fault_meter, [sink(Ctx), self()]),
    {Dur, Results} = window_tagged([{bulk, B} || B <- Senders] ++ [{probe, Prober},
                                                                  {faults, Meter}],
                                   P, Ctx),
    stop_all([S | Sinks]),
    Probes = [X || {probe, X} <- Results],
    Bulk = [X || {bulk, X} <- Results],
    MB = length(Bulk) * Size / 1.0e6,
    Faults = maps:from_list([{sink_faults_mb, F / MB} || {faults, F} <- Results, MB > 0]),
    maps:merge((latency_figures(Probes))#{rt_s => length(Probes) / Dur,
                                          bulk_mb_s => MB / Dur},
               Faults);
%% One message to many processes on the sink nodes, to their pids or to a pg
%% group's members (convoy_bench_fanout).
measure(Fan, P, Ctx) when Fan =:= fanout; Fan =:= publish ->
    convoy_bench_fanout:measure(Fan, P, Ctx);
%% Phoenix.PubSub from the driver to subscribers on the sink nodes
%% (convoy_bench_pubsub).
measure(pubsub, P, Ctx) ->
    convoy_bench_pubsub:measure(P, Ctx);
%% Clusters of more than two nodes (convoy_bench_mesh).
measure(mesh, P, Ctx) ->
    convoy_bench_mesh:measure(P, Ctx);
%% seed 004: a producer and a slow consumer, on the driver node (`same') or on the
%% sink node (`cross'): flooding, syncing every `every', or through a credit
%% channel (`convoy_channel', window `window', `ack_every' 0 = its default). The
%% consumer reports its peak queue length and its peak process memory
%% (convoy_bench_flow).
measure(flow, P, Ctx) ->
    convoy_bench_flow:measure(P, Ctx).

%%--------------------------------------------------------------------
%% Building blocks

-spec snd(mode(), term(), term()) -> term(). % one message the mode's way
-compile({inline, [snd/3]}).
snd(plain, Dest, Msg) -> erlang:send(Dest, Msg);
snd(call, Dest, Msg) -> convoy_bench_call:send(Dest, Msg);
snd(convoy, Dest, Msg) -> convoy:send(Dest, Msg);
snd(send_many, Dest, Msg) -> convoy:send(Dest, Msg);
snd(batch, Dest, Msg) -> convoy:batch(fun() -> convoy:send(Dest, Msg) end);
snd(ceiling, Dest, Msg) -> convoy_bench_ceiling:send(Dest, Msg);
snd(handover, Dest, Msg) -> convoy_bench_handover:send(Dest, Msg);
snd(guarded, Dest, Msg) -> convoy_bench_handover:send_guarded(Dest, Msg).

-spec sink(ctx()) -> node().
sink(#{sinks := [Node | _]}) -> Node.

-spec timeout(ctx()) -> pos_integer(). % ms, for any one answer
timeout(#{timeout := T}) -> T.

-spec secs(integer()) -> float(). % native time units in seconds
secs(Native) -> erlang:convert_time_unit(Native, native, nanosecond) / 1.0e9.

nanos(Native) -> erlang:convert_time_unit(Native, native, nanosecond).

us(Native) -> erlang:convert_time_unit(Native, native, nanosecond) / 1000.

%% N messages to a fresh consumer, then `done'; rate in messages per second from
%% the first send to the consumer's answer, and the sender's time (native units)
%% from the first send to the return of the last. Checks that nothing was lost.
%% `What' is a message shape (`atom', `event', `phoenix') or `{data, Term}' (always
%% Term).
oneway(Ctx, N, What) ->
    oneway(Ctx, N, What, ?SINK_OPTS).

%% The same to a consumer spawned with `SinkOpts'.
oneway(Ctx = #{mode := M}, N, What, SinkOpts) ->
    C = spawn_opt(sink(Ctx), ?MODULE, consumer, [M, 0], SinkOpts),
    T0 = erlang:monotonic_time(),
    send_all(M, C, What, N),
    Ts = erlang:monotonic_time(),
    finish(M, C, {done, self()}),
    Count = receive
                {done, C, Cnt} -> Cnt
            after timeout(Ctx) -> exit({timeout, oneway_consumer})
            end,
    T1 = erlang:monotonic_time(),
    Count =:= N orelse exit({lost, N - Count}),
    {N / secs(T1 - T0), Ts - T0}.

%% N messages to Dest. The ceiling's sender batches them itself: lists of
%% `max_batch' entries, or of as many as fit in convoy's `large_threshold' (64 KiB)
%% of payload, a message alone going as a plain send (batching large messages buys
%% nothing, see `convoy_bench_ceiling'). `send_many' hands convoy lists of
%% `max_batch'; `batch' makes the convoy mode's sends, `max_batch' of them in each
%% `convoy:batch/1' scope (the last one shorter).
-spec send_all(mode(), pid(), term(), non_neg_integer()) -> term().
send_all(ceiling, Dest, What, N) ->
    PerList = case What of
                  {data, Bin} when is_binary(Bin) ->
                      max(1, min(convoy_bench_ceiling:batch_size(), 65536 div byte_size(Bin)));
                  _ ->
                      convoy_bench_ceiling:batch_size()
              end,
    ceiling_n(Dest, What, 1, N, PerList, 0, []);
send_all(send_many, Dest, What, N) ->
    many_n(Dest, What, 1, N, convoy_bench_ceiling:batch_size(), 0, []);
send_all(batch, Dest, What, N) ->
    scopes_n(Dest, What, 1, N, convoy_bench_ceiling:batch_size());
send_all(M, Dest, What, N) ->
    send_n(M, Dest, What, 1, N).

%% @doc The last message of a sender: behind everything it sent.
-spec finish(mode(), pid(), term()) -> term().
finish(ceiling, Dest, Msg) -> convoy_bench_ceiling:ship(node(Dest), [{Dest, Msg}]);
finish(M, Dest, Msg) -> snd(M, Dest, Msg).

ceiling_n(Dest, _What, I, N, _PerList, _K, Acc) when I > N ->
    ceiling_ship(Dest, lists:reverse(Acc));
ceiling_n(Dest, What, I, N, PerList, PerList, Acc) ->
    ceiling_ship(Dest, lists:reverse(Acc)),
    ceiling_n(Dest, What, I, N, PerList, 0, []);
ceiling_n(Dest, What, I, N, PerList, K, Acc) ->
    ceiling_n(Dest, What, I + 1, N, PerList, K + 1, [{Dest, shaped(What, I)} | Acc]).

%% convoy:send_many/1 in lists of `PerList' messages.
many_n(_Dest, _What, I, N, _PerList, _K, Acc) when I > N ->
    convoy:send_many(lists:reverse(Acc));
many_n(Dest, What, I, N, PerList, PerList, Acc) ->
    ok = convoy:send_many(lists:reverse(Acc)),
    many_n(Dest, What, I, N, PerList, 0, []);
many_n(Dest, What, I, N, PerList, K, Acc) ->
    many_n(Dest, What, I + 1, N, PerList, K + 1, [{Dest, shaped(What, I)} | Acc]).

%% Messages I..N sent as the convoy mode sends them, in convoy:batch/1 scopes of
%% `PerScope' sends.
scopes_n(_Dest, _What, I, N, _PerScope) when I > N ->
    ok;
scopes_n(Dest, What, I, N, PerScope) ->
    Last = min(N, I + PerScope - 1),
    ok = convoy:batch(fun() -> send_n(convoy, Dest, What, I, Last) end),
    scopes_n(Dest, What, Last + 1, N, PerScope).

ceiling_ship(_Dest, []) -> ok;
ceiling_ship(Dest, [{Dest, Msg}]) -> Dest ! Msg, ok;
ceiling_ship(Dest, Entries) -> convoy_bench_ceiling:ship(node(Dest), Entries).

%% @doc Message `I' of shape `What' (a shape's own terms: `message/2').
-spec shaped(atom | event | phoenix | {data, term()}, integer()) -> term().
-compile({inline, [shaped/2]}).
shaped(atom, _I) -> message;
shaped({data, Term}, _I) -> Term;
shaped(Shape, I) -> message(Shape, I).

%% Messages I..N. The event and phoenix shapes are built per message (their Id is
%% I), as a real sender would; the others are the same term every time.
send_n(_M, _Dest, _What, I, N) when I > N -> ok;
send_n(M, Dest, atom, I, N) ->
    snd(M, Dest, message),
    send_n(M, Dest, atom, I + 1, N);
send_n(M, Dest, Shape, I, N) when Shape =:= event; Shape =:= phoenix ->
    snd(M, Dest, message(Shape, I)),
    send_n(M, Dest, Shape, I + 1, N);
send_n(M, Dest, {data, Term} = What, I, N) ->
    snd(M, Dest, Term),
    send_n(M, Dest, What, I + 1, N).

%% The realistic message shapes. `event': a tagged tuple with the sequence number,
%% a small binary and a small map. `phoenix': what a Phoenix.PubSub broadcast of a
%% channel message carries, ten binary keys and a payload map of a few string
%% keys, about 420 bytes encoded (`phoenix_shape_test'), the sequence number in
%% its ref, payload and timestamp.
-compile({inline, [message/2]}).
message(event, Id) -> {event, Id, <<"user-42">>, #{k => Id}};
message(phoenix, Id) ->
    #{<<"topic">> => <<"room:lobby">>,
      <<"event">> => <<"new_msg">>,
      <<"ref">> => integer_to_binary(Id),
      <<"join_ref">> => <<"12">>,
      <<"payload">> => #{<<"body">> => <<"see you all at the standup in ten minutes">>,
                         <<"user_id">> => 42,
                         <<"user">> => <<"user-42">>,
                         <<"msg_id">> => Id,
                         <<"mentions">> => <<"user-7,user-19">>},
      <<"status">> => <<"ok">>,
      <<"node">> => <<"app@web-1.example.internal">>,
      <<"channel">> => <<"Elixir.MyAppWeb.RoomChannel">>,
      <<"sent_at">> => 1764000000000 + Id,
      <<"serializer">> => <<"Elixir.Phoenix.Socket.V2.JSONSerializer">>}.

pingpong_rate(Ctx = #{mode := M}, N) ->
    C = spawn_opt(sink(Ctx), ?MODULE, consumer, [M, 0], ?SINK_OPTS),
    Ping = {ping, self()},
    T0 = erlang:monotonic_time(),
    ping_n(M, C, Ping, N),
    T1 = erlang:monotonic_time(),
    C ! stop,
    N / secs(T1 - T0).

ping_n(_M, _C, _Ping, 0) -> ok;
ping_n(M, C, Ping, N) ->
    snd(M, C, Ping),
    receive pong -> ping_n(M, C, Ping, N - 1) end.

%% @doc Counts what it gets; answers pings; reports the count on `done'.
-spec consumer(mode(), non_neg_integer()) -> ok.
consumer(M, Count) ->
    receive
        {ping, From} -> snd(M, From, pong), consumer(M, Count);
        {done, From} -> snd(M, From, {done, self(), Count});
        stop -> ok;
        _ -> consumer(M, Count + 1)
    end.

%% @doc The seed's flood_pong: a registered process answering every ping (an
%% event is answered to the owner).
-spec pong(mode(), atom(), pid()) -> ok.
pong(M, Name, Owner) ->
    true = register(Name, self()),
    Owner ! {registered, self()},
    pong_loop(M, Owner).

pong_loop(M, Owner) ->
    receive
        {ping, From} -> snd(M, From, pong), pong_loop(M, Owner);
        {event, _, _, _} -> snd(M, Owner, pong), pong_loop(M, Owner);
        stop -> ok
    end.

%% @doc One of the seed's spawned pingers: one ping (`{ping, Collector}' or the
%% event numbered `Id'), then gone.
-spec pinger(mode(), {atom(), node()}, {ping | event, pid()}, pos_integer()) -> ok.
pinger(M, Dest, {ping, Collector}, _Id) ->
    snd(M, Dest, {ping, Collector});
pinger(M, Dest, {event, _Collector}, Id) ->
    snd(M, Dest, message(event, Id)).

spawn_pingers(0, _M, _Dest, _What) -> ok;
spawn_pingers(N, M, Dest, What) ->
    _ = spawn(?MODULE, pinger, [M, Dest, What, N]),
    spawn_pingers(N - 1, M, Dest, What).

count(_Msg, 0, _Ctx) -> ok;
count(Msg, N, Ctx) ->
    receive Msg -> count(Msg, N - 1, Ctx)
    after timeout(Ctx) -> exit({timeout, {missing, N, Msg}})
    end.

-spec await(term(), ctx()) -> ok. % exactly Msg, or exit at the timeout
await(Msg, Ctx) ->
    receive Msg -> ok
    after timeout(Ctx) -> exit({timeout, Msg})
    end.

%% @doc Spawn `N' request/response servers here (called on the sink node).
-spec spawn_servers(mode(), pos_integer()) -> [pid()].
spawn_servers(M, N) ->
    [spawn_opt(?MODULE, server, [M], ?SINK_OPTS) || _ <- lists:seq(1, N)].

%% @doc Answers `{req, From, _}' with `resp'; takes `{burst, _}' without answer.
-spec server(mode()) -> ok.
server(M) ->
    receive
        {req, From, _} -> snd(M, From, resp), server(M);
        {burst, _} -> server(M);
        stop -> ok
    end.

stop_all(Pids) -> [P ! stop || P <- Pids], ok.

%% A gen_server (convoy_bench_gen) on Node, under a host process running this
%% module's code (so that a reset kills it with the measurement); it tells the
%% driver `{casts_done, Server}' when it has counted Expected casts.
gen_on(Node, Expected, Ctx) ->
    Host = spawn_opt(Node, ?MODULE, gen_host, [Expected, self()], ?SINK_OPTS),
    receive {gen_ready, Host, Server} -> {Host, Server}
    after timeout(Ctx) -> exit({timeout, gen_server_start})
    end.

%% @doc Starts and links the measured gen_server, then stops it on `stop'.
-spec gen_host(non_neg_integer(), pid()) -> ok.
gen_host(Expected, Driver) ->
    {ok, Server} = gen_server:start_link(convoy_bench_gen, {Expected, Driver},
                                         [{spawn_opt, ?SINK_OPTS}]),
    Driver ! {gen_ready, self(), Server},
    receive stop -> gen_server:stop(Server) end.

-compile({inline, [cast/3, call/3]}).
cast(plain, Server, Req) -> gen_server:cast(Server, Req);
cast(convoy, Server, Req) -> convoy:cast(Server, Req);
%% what gen_server:cast/2 sends, handed over
cast(handover, Server, Req) -> convoy_bench_handover:send(Server, {'$gen_cast', Req});
cast(guarded, Server, Req) -> convoy_bench_handover:send_guarded(Server, {'$gen_cast', Req}).

call(plain, Server, Req) -> gen_server:call(Server, Req, infinity);
call(convoy, Server, Req) -> convoy:call(Server, Req, infinity).

%% @doc Casts the events numbered From..To once told `go'.
-spec caster(mode(), pid(), pos_integer(), pos_integer(), pid()) -> ok.
caster(M, Server, From, To, Driver) ->
    Driver ! {caster_ready, self()},
    receive go -> cast_n(M, Server, From, To) end.

cast_n(_M, _Server, I, To) when I > To -> ok;
cast_n(M, Server, I, To) ->
    ok = cast(M, Server, message(event, I)),
    cast_n(M, Server, I + 1, To).

%% @doc A closed-loop caller (see `window_loop/7'): one call with the event
%% numbered Id per exchange.
-spec caller(mode(), pid(), pid()) -> ok.
caller(M, Server, Driver) ->
    receive
        {go, Warm, Deadline} ->
            Exchange = fun(Id) -> ok = call(M, Server, message(event, Id)) end,
            window_loop(Exchange, fun(T0, T1) -> T1 - T0 end, Driver, Warm, Deadline, 1, [])
    end.

after_burst(_M, _S, _Req, 0) ->
    ok;
after_burst(M, S, Req, B) ->
    [snd(M, S, {burst, I}) || I <- lists:seq(1, B)],
    _ = round_trips(M, S, Req, 1, []),
    timer:sleep(5).

round_trips(_M, _S, _Req, 0, Acc) -> Acc;
round_trips(M, S, Req, N, Acc) ->
    T0 = erlang:monotonic_time(),
    snd(M, S, Req),
    receive resp -> ok end,
    round_trips(M, S, Req, N - 1, [erlang:monotonic_time() - T0 | Acc]).

%% @doc A closed-loop client: waits for `go', then does round trips until the
%% deadline; keeps the latency of those that started after the warm-up and ended
%% before the deadline; answers `{window_done, self(), Samples}'.
%% Its requests: `{req, Body}' sends `{req, Self, Body}'; `{event, Payload}' sends
%% `{req, Self, {event, Id, <<"user-42">>, #{k => Id, body => Payload}}}', Id the
%% client's sequence number; `{paced, GapMs, What}' waits GapMs after each
%% answer before its next request, `{jittered, MeanMs, What}' a random 0 to
%% 2 * MeanMs (neither wait counted in the latency). Many clients paced alike
%% wake at the same timer ticks run after run, and where each falls in those
%% bursts sets the median: 16 pairs 1 ms apart measured `!' against itself at
%% 0.82x-1.30x the p50 (five runs of a scratch driver); jittered, 0.97x-1.05x.
-spec client(mode(), pid(),
             {req | event, term()} | {paced | jittered, non_neg_integer(), {req | event, term()}},
             pid()) -> ok.
client(M, Server, What0, Driver) ->
    {Pause, What} = case What0 of
                        {paced, Gap, W} -> {{fixed, Gap}, W};
                        {jittered, Mean, W} -> {{jitter, Mean}, W};
                        _ -> {none, What0}
                    end,
    Exchange = exchange(M, Server, What),
    receive
        {go, Warm, Deadline} ->
            window_loop(Exchange, fun(T0, T1) -> T1 - T0 end, Driver, Warm, Deadline, 1, [],
                        Pause)
    end.

exchange(M, Server, {req, Body}) ->
    Req = {req, self(), Body},
    fun(_Id) -> snd(M, Server, Req), receive resp -> ok end end;
exchange(M, Server, {event, Payload}) ->
    Self = self(),
    fun(Id) ->
            snd(M, Server, {req, Self, {event, Id, <<"user-42">>, #{k => Id, body => Payload}}}),
            receive resp -> ok end
    end.

%% Exchange(Id) (one request and its answer; Id counts from 1) again and again
%% until the deadline; keeps Sample(T0, T1) of the exchanges that started after the
%% warm-up and ended before the deadline, then answers `{window_done, self(),
%% Samples}'.
window_loop(Exchange, Sample, Driver, Warm, Deadline, Id, Acc) ->
    window_loop(Exchange, Sample, Driver, Warm, Deadline, Id, Acc, none).

%% The same with a pause after each exchange (`client/4').
window_loop(Exchange, Sample, Driver, Warm, Deadline, Id, Acc, Pause) ->
    T0 = erlang:monotonic_time(),
    case T0 >= Deadline of
        true ->
            Driver ! {window_done, self(), Acc},
            ok;
        false ->
            Exchange(Id),
            T1 = erlang:monotonic_time(),
            Acc1 = case T0 >= Warm andalso T1 =< Deadline of
                       true -> [Sample(T0, T1) | Acc];
                       false -> Acc
                   end,
            pause(Pause),
            window_loop(Exchange, Sample, Driver, Warm, Deadline, Id + 1, Acc1, Pause)
    end.

pause(none) -> ok;
pause({fixed, Ms}) -> timer:sleep(Ms);
pause({jitter, MeanMs}) -> timer:sleep(rand:uniform(2 * MeanMs + 1) - 1).

%% Start `Workers' together; they report `{window_done, Pid, Samples}' after the
%% deadline. Returns the measured window in seconds and all samples.
window(Workers, P, Ctx) ->
    {Dur, Tagged} = window_tagged([{x, W} || W <- Workers], P, Ctx),
    {Dur, [S || {x, S} <- Tagged]}.

window_tagged(Tagged, #{warmup_ms := WarmMs, duration_ms := DurMs}, Ctx) ->
    Now = erlang:monotonic_time(),
    Warm = Now + erlang:convert_time_unit(WarmMs, millisecond, native),
    Deadline = Warm + erlang:convert_time_unit(DurMs, millisecond, native),
    [W ! {go, Warm, Deadline} || {_, W} <- Tagged],
    Samples = lists:append(
                [receive
                     {window_done, W, S} -> [{Tag, X} || X <- S]
                 after timeout(Ctx) + DurMs + WarmMs -> exit({timeout, window})
                 end || {Tag, W} <- Tagged]),
    {secs(Deadline - Warm), Samples}.

latency_figures([]) ->
    #{};
latency_figures(Samples) ->
    Sorted = lists:sort(Samples),
    #{p50_us => us(convoy_bench_stats:percentile(50, Sorted)),
      p99_us => us(convoy_bench_stats:percentile(99, Sorted)),
      p999_us => us(convoy_bench_stats:percentile(99.9, Sorted)),
      max_us => us(lists:last(Sorted))}.

%% @doc A window's worker that measures instead of sending: the minor page faults
%% of `Node''s OS process from the window's start to its end (one sample; none
%% where /proc is not there). A node that receives bulk in pieces faults in fresh
%% pages when its allocators give emptied carriers back to the OS (doc/design.md,
%% messages in pieces, "Turns").
-spec fault_meter(node(), pid()) -> ok.
fault_meter(Node, Driver) ->
    receive {go, Warm, Deadline} -> ok end,
    sleep_until(Warm),
    F0 = minor_faults(Node),
    sleep_until(Deadline),
    F1 = minor_faults(Node),
    Driver ! {window_done, self(), [F1 - F0 || is_integer(F0), is_integer(F1)]},
    ok.

sleep_until(T) ->
    timer:sleep(max(0, erlang:convert_time_unit(T - erlang:monotonic_time(), native,
                                                millisecond))).

minor_faults(Node) ->
    try erpc:call(Node, convoy_bench_chunk, os_counts, []) of
        {_Ticks, Faults} -> Faults
    catch
        _:_ -> undefined
    end.

%% K sinks on the sink node, each with its sender here.
bulk_pairs(K, Size, Ctx = #{mode := M}) ->
    Node = sink(Ctx),
    Sinks = [spawn_opt(Node, ?MODULE, bulk_sink, [M], ?SINK_OPTS) || _ <- lists:seq(1, K)],
    Bin = binary:copy(<<"b">>, Size),
    Senders = [spawn_link(?MODULE, bulk_sender, [M, S, Bin, self()]) || S <- Sinks],
    {Sinks, Senders}.

%% @doc The seed's sink: answers each binary with `is_binary/1' of it.
-spec bulk_sink(mode()) -> ok.
bulk_sink(M) ->
    receive
        {From, Bin} -> snd(M, From, is_binary(Bin)), bulk_sink(M);
        stop -> ok
    end.

%% @doc Sends its binary, waits for the answer, again, until the deadline; one
%% sample per binary acknowledged inside the window.
-spec bulk_sender(mode(), pid(), binary(), pid()) -> ok.
bulk_sender(M, Sink, Bin, Driver) ->
    receive
        {go, Warm, Deadline} ->
            Msg = {self(), Bin},
            Exchange = fun(_Id) -> snd(M, Sink, Msg), receive true -> ok end end,
            window_loop(Exchange, fun(_, _) -> 1 end, Driver, Warm, Deadline, 1, [])
    end.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

%% The phoenix shape: ten binary keys, a payload map of string keys, 300-600
%% bytes encoded whatever its Id, a term of its own per message.
phoenix_shape_test() ->
    Ids = [1, 999, 1000000, 1 bsl 40],
    [begin
         M = message(phoenix, Id),
         ?assertEqual(10, map_size(M)),
         ?assert(lists:all(fun is_binary/1, maps:keys(M))),
         #{<<"payload">> := P} = M,
         ?assert(lists:all(fun is_binary/1, maps:keys(P))),
         Bytes = erlang:external_size(M),
         ?assert(Bytes >= 300 andalso Bytes =< 600, {Id, Bytes})
     end || Id <- Ids],
    [First, Second] = [message(phoenix, Id) || Id <- lists:seq(1, 2)],
    ?assertNotEqual(First, Second),
    ?assertEqual(message(phoenix, 7), shaped(phoenix, 7)).
-endif.
