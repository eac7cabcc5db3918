%% `bin/convoy-bench cost': what one `convoy:send/2' on the batched path costs, step
%% by step, on nodes the harness starts (A sends, B receives, convoy running on
%% both with its defaults).
%%
%% Each sender step is timed in a loop of `n' iterations on node A, in the sending
%% process, with the loop's own cost (an empty iteration) subtracted; the figure
%% is the fastest of `repeat' loops, ns per iteration (wall time: the fastest loop
%% is the one another OS process did not interrupt). The whole send, the lane and
%% the encoding are timed in CPU time of node A (`statistics(runtime)', the only
%% busy process of node A then, whose schedulers do not spin when idle), median of
%% `repeat': the machine is shared, and CPU time does not count the time other
%% programs take. The steps are the calls
%% convoy_route makes for a small message to a busy lane (admission, batching
%% average, size, held bound, the hand-over to the lane), called directly with
%% convoy's own state; the held bound's step is timed on a private word (taking
%% room on the node's real one would fill it).
%%
%% The lane's and the receiver's share come from whole runs: `n' messages sent
%% while the sender's lane is suspended, then the lane resumed and timed until
%% `convoy:flush/0' returns (the lane handles the messages back to back, batches
%% of `max_batch', shipping included); the same messages shipped by the sender
%% itself as lists of `max_batch' `{To, Msg}' entries (the encoding the lane's
%% ships also pay); and the receiving inbox's check of one entry.
%%
%% Beside the whole send, the `guarded' variant's send (`convoy_bench_handover',
%% its batcher suspended as the lane is): a hand-over with only the per-message
%% work convoy's promises need, the floor of any design that keeps them; and
%% beside the lane, that batcher's handling and shipping, timed as the lane's.
%%
%% Then the first send of a fresh process, as in the seed's flood (`[fresh]'),
%% for convoy, the guarded floor, the bare hand-over and `!'.
%%
%% Then a stream as `oneway' makes it (`[stream cpu]'): one process on A sends `n'
%% messages, each built as it is sent, to a counting process on B, by convoy, by
%% the guarded floor and by the bare hand-over, alternated `repeat' times; the CPU
%% each node spent from the first send to the last message counted, per message
%% (median). The steps above are each timed alone; a stream runs them all at once,
%% the lane's per-batch work, the encoding, the receiving side and the wake-ups
%% included, on both nodes.
%%
%% Last, the send call where the hot-path's cost shows (`[exchange]'): one, then
%% four request/response pairs between A and B, both sides sending by
%% `convoy:send/2', then by `!' behind one call to another module's function
%% (what calling any library's send costs), then by `!', phases of
%% `exchange_ms' alternated `repeat' times; each client times its own send calls
%% (wall time, the median phase). In a loop the steps above stay in the CPU's
%% caches; between the messages of an exchange they do not, and the call costs
%% several times what its steps add up to (most with one pair, whose node idles
%% between its messages).
-module(convoy_bench_cost).

-export([run/1, text/1]).
%% Called on node A.
-export([measure/2, sink/0, exchange_server/1]).
%% Called on node B and A by the stream rows.
-export([stream_sink/2, stream_send/4]).

-include("../src/convoy_runtime.hrl").

%% The harness's message shapes (`convoy_bench_measure:shaped/2').
-define(SHAPES, [atom, event, phoenix]).

-type row() :: #{step := binary(), shape := atom | event | phoenix, ns := float()}.
-export_type([row/0]).

%% @doc Measure on fresh peer nodes; `Opts' as parsed by `convoy_bench' (`size'
%% tiny gives a quick smoke run).
-spec run(map()) -> {ok, #{cost := [row()], text := binary()}}.
run(Opts) ->
    {N, Repeat, PhaseMs} = case maps:get(size, Opts, normal) of
                               tiny -> {2000, 3, 50};
                               normal -> {200000, 7, 1000}
                           end,
    %% Schedulers that do not spin when idle: CPU time is then work done.
    NoSpin = ["+sbwt", "none", "+sbwtdcpu", "none", "+sbwtdio", "none"],
    Nodes0 = convoy_bench_nodes:new(#{given => none,
                                      peer_args => NoSpin ++ maps:get(peer_args, Opts, [])}),
    {[A, B], Nodes1} = convoy_bench_nodes:prepare(default, 2, #{}, Nodes0),
    try
        Sink = erpc:call(B, erlang, spawn, [?MODULE, sink, []]),
        Rows = erpc:call(A, ?MODULE, measure,
                         [Sink, #{n => N, repeat => Repeat, exchange_ms => PhaseMs}], infinity)
            ++ stream_rows(A, B, 5 * N, Repeat),
        Text = iolist_to_binary(text(Rows)),
        io:put_chars(Text),
        {ok, #{cost => Rows, text => Text}}
    after
        convoy_bench_nodes:stop(Nodes1)
    end.

%% @doc The breakdown as a table.
-spec text([row()]) -> iodata().
text(Rows) ->
    Ordered = [S || #{step := S, shape := atom} <- Rows],
    ["cost of one convoy:send/2 on the batched path, ns per message; [cpu]: median of "
     "repeats, CPU time of node A; [stream cpu]: a one-way stream's CPU time on each "
     "node, median of alternated runs; [exchange]: the call inside 1 or 4 "
     "request/response pairs, median of alternated phases, wall time; others: "
     "fastest of repeats, wall time\n",
     io_lib:format("  ~-62s ~9s ~9s ~9s~n", ["step" | [atom_to_list(Sh) || Sh <- ?SHAPES]]),
     [io_lib:format("  ~-62s ~9.1f ~9.1f ~9.1f~n", [S | [ns(Rows, S, Sh) || Sh <- ?SHAPES]])
      || S <- Ordered]].

ns(Rows, Step, Shape) ->
    hd([Ns || #{step := S, shape := Sh, ns := Ns} <- Rows, S =:= Step, Sh =:= Shape]).

%% @doc Discards everything (on node B).
-spec sink() -> no_return().
sink() ->
    receive _ -> sink() end.

%% @doc Runs on node A: every step for each message shape.
-spec measure(pid(), #{n := pos_integer(), repeat := pos_integer(),
                        exchange_ms := pos_integer()}) -> [row()].
measure(Sink, Params) ->
    process_flag(priority, high),
    lists:append([shape_rows(Shape, Sink, Params) ++ fresh_rows(Shape, Sink, Params)
                  ++ exchange_rows(Shape, node(Sink), Params)
                  || Shape <- ?SHAPES]).

%% The seed's flood: each pinger is a fresh process that sends once. For each
%% way of sending, K fresh processes, one after the other, each time its one
%% send (`[fresh] ... in the call': the median, wall time) and report it; and
%% node A's CPU per process for the same (`[fresh cpu]'), less that of processes
%% that only time nothing and report (spawn, report and exit stay out). What a
%% send leaves in a process (its dictionary, its heap) is paid in the process's
%% exit, which the CPU figure includes and the call's does not.
-define(FRESH_MODES, [{convoy, <<"convoy:send/2">>},
                      {guarded, <<"guarded send_guarded/2">>},
                      {handover, <<"hand-over (5-tuple)">>},
                      {plain, <<"! to the remote process">>}]).

fresh_rows(Shape, Sink, #{n := N, repeat := R}) ->
    K = min(N, 100000),
    Msg = message(Shape),
    Base = median([element(2, fresh_run(fun() -> ok end, K)) || _ <- lists:seq(1, R)]),
    lists:append(
      [begin
           Runs = [fresh_env(Mode, Sink, Msg, fun(Send) -> fresh_run(Send, K) end)
                   || _ <- lists:seq(1, R)],
           [#{step => <<"[fresh] first send, in the call: ", Name/binary>>,
              shape => Shape, ns => float(median([Call || {Call, _} <- Runs]))},
            #{step => <<"[fresh cpu] first send, per process: ", Name/binary>>,
              shape => Shape, ns => max(0.0, median([Cpu || {_, Cpu} <- Runs]) - Base)}]
       end || {Mode, Name} <- ?FRESH_MODES]).

%% Run(Send) where Send makes the mode's send; the lane (or the guarded batcher,
%% or the hand-over's receiver) suspended meanwhile, so every send is batched.
fresh_env(convoy, Sink, Msg, Run) ->
    Lanes = [L || {_Node, #runtime{lanes = Ls}} <- convoy_runtimes:rows(), L <- tuple_to_list(Ls)],
    [true = erlang:suspend_process(L) || L <- Lanes],
    Result = Run(fun() -> convoy:send(Sink, Msg) end),
    [true = erlang:resume_process(L) || L <- Lanes],
    ok = convoy:flush(),
    Result;
fresh_env(guarded, Sink, Msg, Run) ->
    ok = convoy_bench_handover:start([node()]),
    true = erlang:suspend_process(convoy_bench_handover:guarded_batcher()),
    Result = Run(fun() -> convoy_bench_handover:send_guarded(Sink, Msg) end),
    ok = convoy_bench_handover:stop([node()]),
    Result;
fresh_env(handover, Sink, Msg, Run) ->
    P = spawn_opt(fun() -> receive stop -> ok end end, [{message_queue_data, off_heap}]),
    true = erlang:suspend_process(P),
    Node = node(Sink),
    Result = Run(fun() -> P ! {'$convoy_send', Node, Sink, Msg, 0} end),
    exit(P, kill),
    Result;
fresh_env(plain, Sink, Msg, Run) ->
    Run(fun() -> Sink ! Msg end).

%% K fresh processes, one at a time, each timing Send once: {median ns in the
%% call, CPU ns of node A per process}.
fresh_run(Send, K) ->
    Self = self(),
    {T0, _} = statistics(runtime),
    Times = fresh_spawn(Self, Send, K, []),
    {T1, _} = statistics(runtime),
    {median(Times), (T1 - T0) * 1.0e6 / K}.

fresh_spawn(_Self, _Send, 0, Acc) ->
    Acc;
fresh_spawn(Self, Send, K, Acc) ->
    Pid = spawn(fun() ->
                        T0 = erlang:monotonic_time(),
                        _ = Send(),
                        T1 = erlang:monotonic_time(),
                        Self ! {self(), T1 - T0}
                end),
    receive
        {Pid, Native} ->
            fresh_spawn(Self, Send, K - 1,
                        [erlang:convert_time_unit(Native, native, nanosecond) | Acc])
    end.

%% The stream rows, from the harness's node: per shape, the modes alternated
%% `R' times, each run's CPU of A and of B per message.
-define(STREAM_MODES, [{convoy, <<"convoy:send/2">>}, {guarded, <<"guarded floor">>},
                       {handover, <<"bare hand-over">>}]).

stream_rows(A, B, N, R) ->
    ok = convoy_bench_handover:start([A, B]),
    try
        lists:append(
          [begin
               Runs = [{Mode, stream_run(Mode, Shape, A, B, N)}
                       || _ <- lists:seq(1, R), {Mode, _} <- ?STREAM_MODES],
               [#{step => <<"[stream cpu] node ", Which/binary, ", per message: ", Name/binary>>,
                  shape => Shape,
                  ns => median([element(I, Cpu) || {M, Cpu} <- Runs, M =:= Mode])}
                || {I, Which} <- [{1, <<"A">>}, {2, <<"B">>}], {Mode, Name} <- ?STREAM_MODES]
           end || Shape <- ?SHAPES])
    after
        convoy_bench_handover:stop([A, B])
    end.

%% One stream: {A's CPU ns, B's CPU ns} per message.
stream_run(Mode, Shape, A, B, N) ->
    Self = self(),
    Sink = erpc:call(B, erlang, spawn_opt, [?MODULE, stream_sink, [Self, N],
                                            [{message_queue_data, off_heap}]]),
    Cpu = fun() -> [element(1, erpc:call(X, erlang, statistics, [runtime])) || X <- [A, B]] end,
    [A0, B0] = Cpu(),
    _ = erpc:call(A, erlang, spawn, [?MODULE, stream_send, [Mode, Sink, Shape, N]]),
    receive
        {Sink, counted} -> ok
    after 120000 ->
        exit(Sink, kill),
        error({stream_timeout, Mode, Shape})
    end,
    [A1, B1] = Cpu(),
    {(A1 - A0) * 1.0e6 / N, (B1 - B0) * 1.0e6 / N}.

%% @doc Counts `N' messages, then tells `Parent' (on node B).
-spec stream_sink(pid(), non_neg_integer()) -> ok.
stream_sink(Parent, 0) ->
    Parent ! {self(), counted},
    ok;
stream_sink(Parent, N) ->
    receive _ -> stream_sink(Parent, N - 1) end.

%% @doc `N' messages of `Shape', each built as it is sent, by `Mode' (on node A).
-spec stream_send(convoy | guarded | handover, pid(), atom | event | phoenix,
                  non_neg_integer()) -> ok.
stream_send(Mode, Sink, Shape, N) ->
    _ = convoy_bench_measure:send_all(Mode, Sink, Shape, N),
    ok.

%% The send call's cost inside an exchange: the modes alternated phase by
%% phase (the machine's load drifts), each phase on fresh pairs. One pair waits
%% for each answer with nothing else to run: the call starts from cold caches.
%% `call' (`local_call''s send) tells what the call into any library's send
%% function costs there, before the library's own work.
-define(EXCHANGE_MODES, [convoy, call, plain]).

exchange_rows(Shape, B, #{repeat := R, exchange_ms := Ms}) ->
    lists:append(
      [begin
           Phases = [{Mode, exchange_phase(Mode, message(Shape), B, Ms, Pairs)}
                     || _ <- lists:seq(1, R), Mode <- ?EXCHANGE_MODES],
           [#{step => exchange_step(Pairs, Mode), shape => Shape,
              ns => median([Ns || {M, Ns} <- Phases, M =:= Mode])}
            || Mode <- ?EXCHANGE_MODES]
       end || Pairs <- [1, 4]]).

exchange_step(Pairs, Mode) ->
    iolist_to_binary(io_lib:format("[exchange] send call, ~b pair~s: ~s",
                                   [Pairs, [$s || Pairs > 1],
                                    case Mode of
                                        convoy -> "convoy:send/2";
                                        call -> "! behind one call";
                                        plain -> "! (plain)"
                                    end])).

%% ns per send call of the clients on A, over one phase of Ms.
exchange_phase(Mode, Msg, B, Ms, Pairs) ->
    Self = self(),
    Deadline = erlang:monotonic_time(millisecond) + Ms,
    Clients = [spawn_link(fun() ->
                                  Server = spawn_link(B, ?MODULE, exchange_server, [Mode]),
                                  Self ! {self(), exchange_client(Mode, Server, Msg, Deadline,
                                                                  0, 0)},
                                  unlink(Server),
                                  exit(Server, kill)
                          end) || _ <- lists:seq(1, Pairs)],
    Sums = [receive {C, SumCount} -> SumCount end || C <- Clients],
    {Ns, Calls} = lists:foldl(fun({S, K}, {S0, K0}) -> {S + S0, K + K0} end, {0, 0}, Sums),
    Ns / max(1, Calls).

exchange_client(Mode, Server, Msg, Deadline, Ns, Calls) ->
    case Calls rem 64 =:= 0 andalso erlang:monotonic_time(millisecond) >= Deadline of
        true ->
            {Ns, Calls};
        false ->
            T0 = erlang:monotonic_time(nanosecond),
            exchange_send(Mode, Server, {req, self(), Msg}),
            T1 = erlang:monotonic_time(nanosecond),
            receive resp -> ok end,
            exchange_client(Mode, Server, Msg, Deadline, Ns + T1 - T0, Calls + 1)
    end.

%% @doc Answers each request with the atom `resp' (on node B), sent as `Mode' says.
-spec exchange_server(convoy | call | plain) -> no_return().
exchange_server(Mode) ->
    receive {req, From, _Msg} -> exchange_send(Mode, From, resp) end,
    exchange_server(Mode).

%% The step convoy_route's refs/2 takes (convoy_peers publishes them).
refs_of(Node) ->
    convoy_peers:refs(Node).

exchange_send(convoy, To, Msg) -> convoy:send(To, Msg);
exchange_send(call, To, Msg) -> convoy_bench_call:send(To, Msg);
exchange_send(plain, To, Msg) -> To ! Msg.

shape_rows(Shape, Sink, P0) ->
    Msg = message(Shape),
    RT = #runtime{} = persistent_term:get(?RUNTIME_KEY),
    P = within_bound(P0, Msg, RT),
    Node = node(Sink),
    Row = convoy_runtimes:row(Node),
    L = convoy_lanes:lane_of(Row),
    Slots = element(L, Row#runtime.slots),
    Lane = element(L, Row#runtime.lanes),
    {small, Bytes} = convoy_size:measure(Msg, RT#runtime.large_threshold),
    Word = atomics:new(1, []),
    Discard = spawn(fun Loop() -> receive _ -> Loop() end end),
    Steps =
        [{<<"runtime from persistent_term">>,
          fun() -> persistent_term:get(?RUNTIME_KEY) end},
         {<<"the sender's lane of the node (persistent_term, phash2)">>,
          fun() -> convoy_lanes:lane_of(convoy_runtimes:row(Node)) end},
         {<<"size estimate (convoy_size:measure/2)">>,
          fun() -> convoy_size:measure(Msg, 65536) end},
         {<<"calm: clock + lane's last send + own last send (pdict)">>,
          fun() ->
                  Now = convoy_slots:now_us(RT#runtime.clock),
                  Last = case put('$convoy_cost_last', Now) of
                             undefined -> Now;
                             T -> T
                         end,
                  element(1, convoy_slots:since_last_send(Slots, Now, Now - Last, 1))
          end},
         {<<"calm skipped: clock + own last send + count (pdict)">>,
          fun() ->
                  Now = convoy_slots:now_us(RT#runtime.clock),
                  _ = put('$convoy_cost_last', Now),
                  K = case get('$convoy_cost_skipped') of
                          undefined -> 0;
                          K0 -> K0
                      end,
                  put('$convoy_cost_skipped', (K + 1) rem 16)
          end},
         {<<"batching verdict read (convoy_slots:unpaid_until/1)">>,
          fun() -> convoy_slots:unpaid_until(Slots) end},
         {<<"admission add_get + idle read + dispose (convoy_slots)">>,
          fun() ->
                  V = convoy_slots:admit(Slots),
                  _ = convoy_slots:idle(Slots, V),
                  convoy_slots:dispose(Slots, 1)
          end},
         {<<"node refs (persistent_term) + inbox marker (pdict)">>,
          fun() -> {refs_of(Node), convoy_sender:is_marked(Node)} end},
         {<<"held bound: read + compare_exchange (private word)">>,
          fun() ->
                  Old = atomics:get(Word, 1),
                  atomics:compare_exchange(Word, 1, Old, Old + Bytes + 1)
          end},
         {<<"hand-over: local send of the lane's 5-tuple">>,
          fun() -> Discard ! {'$convoy_send', Node, Sink, Msg, Bytes} end},
         {<<"local destination: convoy:send/2">>,
          fun() -> convoy:send(Discard, Msg) end},
         {<<"local destination: ! (plain)">>,
          fun() -> Discard ! Msg end},
         {<<"[cpu] whole convoy:send/2, sender (lane busy: suspended)">>,
          whole_send(Lane, Sink, Msg)},
         {<<"[cpu] send_many/1, lists of max_batch (lane suspended)">>,
          many_send(Lane, Sink, Msg, RT#runtime.max_batch)},
         {<<"[cpu] guarded floor: send_guarded/2 (batcher suspended)">>,
          {guarded, fun() -> convoy_bench_handover:send_guarded(Sink, Msg) end}},
         {<<"[cpu] hand-over alone: 5-tuple to a suspended process">>,
          {suspended, fun(To) -> To ! {'$convoy_send', Node, Sink, Msg, Bytes} end}},
         {<<"[cpu] local ! to a suspended process">>,
          {suspended, fun(To) -> To ! Msg end}},
         {<<"[cpu] plain erlang:send/2 to the remote process">>,
          {cpu, fun() -> Sink ! Msg end}}],
    Rows = [#{step => Name, shape => Shape, ns => loop_ns(Fun, P)} || {Name, Fun} <- Steps],
    exit(Discard, kill),
    Rows ++ [#{step => <<"[cpu] lane: handling + shipping">>, shape => Shape,
               ns => lane_ns(Lane, Sink, Msg, P)},
             #{step => <<"[cpu] guarded floor's batcher: handling + shipping">>, shape => Shape,
               ns => batcher_ns(Sink, Msg, P)},
             #{step => <<"[cpu] sender shipping lists of max_batch {To, Msg}">>,
               shape => Shape, ns => ship_ns(Sink, Msg, RT#runtime.max_batch, P)},
             #{step => <<"receiving inbox: entry check (convoy_wire:entry/3)">>,
               shape => Shape,
               ns => loop_ns(fun() -> convoy_wire:entry({Sink, Msg}, node(), Node) end, P)}].

%% The loops hold their messages in a suspended lane (or the guarded floor's
%% batcher): at most half of what the node's bound takes, or a send would wait
%% for room that never comes.
within_bound(P = #{n := N}, Msg, #runtime{max_buffered = MaxMsgs, max_buffered_bytes = MaxBytes}) ->
    Fit = min(fit(MaxMsgs, 1), fit(MaxBytes, erlang:external_size(Msg))),
    P#{n := max(1, min(N, Fit))}.

fit(infinity, _Each) -> infinity;
fit(Max, Each) -> Max div (2 * Each).

%% convoy:send_many/1 of lists of PerCall messages, the lane suspended as for
%% `whole_send/3' (a skipped row on a convoy without it).
many_send(Lane, Sink, Msg, PerCall) ->
    List = [{Sink, Msg} || _ <- lists:seq(1, PerCall)],
    case erlang:function_exported(convoy, send_many, 1) of
        true -> {many, Lane, fun() -> convoy:send_many(List) end, PerCall};
        false -> {many, Lane, fun() -> ok end, PerCall}
    end.

%% convoy:send/2 with the lane suspended, so every send takes the batched path;
%% the lane is resumed and drained between loops.
whole_send(Lane, Sink, Msg) ->
    {suspend, Lane, fun() -> convoy:send(Sink, Msg) end}.

loop_ns({suspended, Fun}, #{n := N, repeat := R}) ->
    %% a receiver like the lane (off-heap mailbox), suspended as the lane is
    median([begin
                P = spawn_opt(fun() -> receive stop -> ok end end,
                              [{message_queue_data, off_heap}]),
                true = erlang:suspend_process(P),
                Ns = cpu_ns(fun() -> repeat(fun() -> Fun(P) end, N) end) / N,
                exit(P, kill),
                Ns
            end || _ <- lists:seq(1, R)]);
loop_ns({many, Lane, Fun, PerCall}, #{n := N, repeat := R}) ->
    Calls = max(1, N div PerCall),
    median([begin
                true = erlang:suspend_process(Lane),
                Ns = cpu_ns(fun() -> repeat(Fun, Calls) end) / (Calls * PerCall),
                true = erlang:resume_process(Lane),
                ok = convoy:flush(),
                Ns
            end || _ <- lists:seq(1, R)]);
loop_ns({suspend, Lane, Fun}, #{n := N, repeat := R}) ->
    median([begin
                true = erlang:suspend_process(Lane),
                Ns = cpu_ns(fun() -> repeat(Fun, N) end) / N,
                true = erlang:resume_process(Lane),
                ok = convoy:flush(),
                Ns
            end || _ <- lists:seq(1, R)]);
loop_ns({guarded, Fun}, #{n := N, repeat := R}) ->
    %% the guarded variant's processes on this node alone, fresh for each loop
    %% (its held word starts empty), its batcher suspended as the lane is
    median([begin
                ok = convoy_bench_handover:start([node()]),
                Batcher = convoy_bench_handover:guarded_batcher(),
                true = erlang:suspend_process(Batcher),
                Ns = cpu_ns(fun() -> repeat(Fun, N) end) / N,
                ok = convoy_bench_handover:stop([node()]),
                Ns
            end || _ <- lists:seq(1, R)]);
loop_ns({cpu, Fun}, #{n := N, repeat := R}) ->
    median([cpu_ns(fun() -> repeat(Fun, N) end) / N || _ <- lists:seq(1, R)]);
loop_ns(Fun, #{n := N, repeat := R}) ->
    Fastest = fun(F) -> lists:min([timed(F, N) || _ <- lists:seq(1, R)]) end,
    max(0.0, Fastest(Fun) - Fastest(fun() -> ok end)).

timed(Fun, N) ->
    T0 = erlang:monotonic_time(),
    repeat(Fun, N),
    erlang:convert_time_unit(erlang:monotonic_time() - T0, native, nanosecond) / N.

%% CPU time of this node's schedulers while Fun runs, ns.
cpu_ns(Fun) ->
    {T0, _} = statistics(runtime),
    Fun(),
    {T1, _} = statistics(runtime),
    (T1 - T0) * 1.0e6.

repeat(_Fun, 0) -> ok;
repeat(Fun, N) -> _ = Fun(), repeat(Fun, N - 1).

%% N messages wait in the suspended lane; then the lane's time to ship them all.
lane_ns(Lane, Sink, Msg, #{n := N, repeat := R}) ->
    median([begin
                true = erlang:suspend_process(Lane),
                repeat(fun() -> convoy:send(Sink, Msg) end, N),
                cpu_ns(fun() ->
                               true = erlang:resume_process(Lane),
                               ok = convoy:flush()
                       end) / N
            end || _ <- lists:seq(1, R)]).

%% The same for the guarded floor's batcher (started on this node alone: what it
%% ships to B's deliverer, absent there, is dropped on arrival), until its
%% mailbox is empty and it waits.
batcher_ns(Sink, Msg, #{n := N, repeat := R}) ->
    median([begin
                ok = convoy_bench_handover:start([node()]),
                Batcher = convoy_bench_handover:guarded_batcher(),
                true = erlang:suspend_process(Batcher),
                repeat(fun() -> convoy_bench_handover:send_guarded(Sink, Msg) end, N),
                Ns = cpu_ns(fun() ->
                                    true = erlang:resume_process(Batcher),
                                    drained(Batcher)
                            end) / N,
                ok = convoy_bench_handover:stop([node()]),
                Ns
            end || _ <- lists:seq(1, R)]).

drained(Pid) ->
    case process_info(Pid, [message_queue_len, status]) of
        [{message_queue_len, 0}, {status, waiting}] -> ok;
        _ -> receive after 1 -> drained(Pid) end
    end.

%% The same messages in lists of Max entries sent by this process to the sink.
ship_ns(Sink, Msg, Max, #{n := N, repeat := R}) ->
    Lists = lists:duplicate(max(1, N div Max), [{Sink, Msg} || _ <- lists:seq(1, Max)]),
    median([cpu_ns(fun() -> [Sink ! List || List <- Lists] end) / (length(Lists) * Max)
            || _ <- lists:seq(1, R)]).

%% Built at run time, as an application's messages are: a literal term is not
%% copied by a local send, and would make the hand-over look cheaper than it is.
message(Shape) ->
    convoy_bench_measure:shaped(Shape, erlang:phash2(self(), 1) + 42).

median(L) -> lists:nth((length(L) + 1) div 2, lists:sort(L)).
