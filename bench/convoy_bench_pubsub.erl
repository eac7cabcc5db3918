%% The `pubsub' scenario: Phoenix.PubSub between three nodes, with its own
%% `Phoenix.PubSub.PG2' adapter (variant `pg2') and with `Phoenix.PubSub.Convoy'
%% (integrations/phoenix_pubsub_convoy; the convoy variants), on the same nodes,
%% and with `convoy_bench_pubsub_handover' (variant `handover': convoy's adapter
%% with each remote message handed to a bare batching process, the limit of any
%% design that hands messages to a process).
%%
%% Node A (the driver) publishes, B and C subscribe: on each of them `subscribers'
%% processes subscribe to one topic. `publishers' processes on A broadcast in a
%% closed loop for `duration_ms' after `warmup_ms': each broadcast
%% `{convoy_bench_pub, Publisher, Seq, SentUs, Event}' and waits until the first
%% subscriber of each node (its acker) has acknowledged that broadcast; the acks go
%% as the variant sends (`!' for `pg2', `convoy:send/2' for convoy, the batching
%% process for `handover'), as the answers
%% of `pairs' and `call' do.
%%
%% Latency is one way, publish to delivery: `SentUs' is `os:system_time(microsecond)'
%% on A just before `Phoenix.PubSub.broadcast/3', and the acker reads the same
%% clock when the message reaches it (the ack carries the reading). The nodes run
%% on one host, so both readings come from the one OS clock; `--nodes' on other
%% hosts would compare two clocks (a run across hosts should not trust these
%% latencies). Each broadcast gives one sample per subscribing node.
%%
%% After the window the driver checks that every subscriber received every
%% broadcast made (warm-up included): a lost delivery fails the point.
%%
%% Phoenix.PubSub is Elixir: its beams, the adapter's and Elixir's own (`elixir',
%% `logger') are added to each node's code path from where `make phoenix' or
%% `make phoenix-build' put them (integrations/phoenix_pubsub_convoy/_build/test);
%% without them the scenario reports its runs unavailable (`code_paths/0').
-module(convoy_bench_pubsub).

-export([code_paths/0, elixir_paths/0, root/0, measure/2]).
%% Run on the nodes taking part.
-export([start_pubsub/3, subscribers/4, subscriber/5, publisher/5]).

-define(NAME, convoy_bench_pubsub).
-define(TOPIC, <<"convoy_bench">>).
-define(PUBSUB, 'Elixir.Phoenix.PubSub').

%% @doc The directories Phoenix.PubSub and its adapter need on the code path, on
%% this node's file system: `{ok, Dirs}', or `{error, Why}' (a sentence for the
%% report) when some are missing.
-spec code_paths() -> {ok, [file:filename()]} | {error, binary()}.
code_paths() ->
    Build = filename:join([root(), "integrations", "phoenix_pubsub_convoy", "_build", "test",
                           "lib"]),
    Own = [filename:join([Build, App, "ebin"]) || App <- ["phoenix_pubsub",
                                                         "phoenix_pubsub_convoy"]],
    case [D || D <- Own, not filelib:is_regular(filename:join(D, app_file(D)))] of
        [_ | _] ->
            {error, iolist_to_binary(
                      ["Phoenix.PubSub and its convoy adapter are not built (no ",
                       filename:join(Build, "*/ebin"), "): run `make phoenix-build`"])};
        [] ->
            case elixir_paths() of
                {ok, Elixir} -> {ok, Own ++ Elixir};
                {error, _} = E -> E
            end
    end.

%% @doc The ebin directories of Elixir's own `elixir' and `logger', which every
%% Elixir library the harness loads needs beside its own (Phoenix.PubSub here,
%% manifold in `convoy_bench_fanout'): `{ok, Dirs}', or `{error, Why}' (a sentence
%% for the report) when Elixir is not installed.
-spec elixir_paths() -> {ok, [file:filename()]} | {error, binary()}.
elixir_paths() ->
    case elixir_lib() of
        {ok, Lib} ->
            {ok, [filename:join([Lib, App, "ebin"]) || App <- ["elixir", "logger"]]};
        error ->
            {error, <<"Elixir's own libraries (elixir, logger) were not found: install Elixir">>}
    end.

app_file(Ebin) ->
    filename:basename(filename:dirname(Ebin)) ++ ".app".

%% @doc The repository: the harness's beams are in
%% <root>/_build/<profile>/lib/convoy/bench.
-spec root() -> file:filename().
root() ->
    Beam = code:which(?MODULE),
    lists:foldl(fun(_, D) -> filename:dirname(D) end, Beam, lists:seq(1, 6)).

%% Elixir's lib directory (its `elixir', `logger', ... applications): from the code
%% path when Elixir is on it, else beside the `elixir' executable (symbolic links
%% followed: /usr/bin/elixir -> /usr/lib/elixir/bin/elixir).
elixir_lib() ->
    case code:lib_dir(elixir) of
        Dir when is_list(Dir) ->
            {ok, filename:dirname(Dir)};
        {error, _} ->
            case os:find_executable("elixir") of
                false ->
                    error;
                Exe ->
                    Lib = filename:join(filename:dirname(filename:dirname(resolve(Exe, 20))),
                                        "lib"),
                    case filelib:is_regular(filename:join([Lib, "elixir", "ebin",
                                                           "elixir.app"])) of
                        true -> {ok, Lib};
                        false -> error
                    end
            end
    end.

resolve(Path, 0) ->
    Path;
resolve(Path, N) ->
    case file:read_link(Path) of
        {ok, Target} -> resolve(filename:absname(Target, filename:dirname(Path)), N - 1);
        {error, _} -> Path
    end.

%% @doc One point on the driver node: `Ctx''s mode `pg2' uses the PG2 adapter,
%% `convoy' Phoenix.PubSub.Convoy.
-spec measure(map(), convoy_bench_measure:ctx()) -> convoy_bench_measure:figures().
measure(#{subscribers := N, publishers := K, warmup_ms := WarmMs, duration_ms := DurMs},
        #{mode := Mode, sinks := Sinks, timeout := Timeout}) ->
    Dirs = case code_paths() of
               {ok, Ds} -> Ds;
               {error, Why} -> exit({phoenix_pubsub_missing, Why})
           end,
    Adapter = case Mode of
                  convoy -> 'Elixir.Phoenix.PubSub.Convoy';
                  pg2 -> 'Elixir.Phoenix.PubSub.PG2';
                  handover -> convoy_bench_pubsub_handover
              end,
    Nodes = [node() | Sinks],
    Holders = [erpc:call(Nd, ?MODULE, start_pubsub, [Dirs, Adapter, self()]) || Nd <- Nodes],
    try
        Subs = [erpc:call(Nd, ?MODULE, subscribers, [N, Mode, self(), Timeout]) || Nd <- Sinks],
        All = lists:append(Subs),
        ready(All, Timeout),
        Ackers = length(Sinks),
        Pubs = [spawn_link(?MODULE, publisher, [Mode, Ackers, self(), I, Timeout])
                || I <- lists:seq(1, K)],
        Now = erlang:monotonic_time(),
        Warm = Now + erlang:convert_time_unit(WarmMs, millisecond, native),
        Deadline = Warm + erlang:convert_time_unit(DurMs, millisecond, native),
        [P ! {go, Warm, Deadline} || P <- Pubs],
        Done = [receive
                    {pub_done, P, Made, Samples} -> {Made, Samples}
                after Timeout + WarmMs + DurMs -> exit({timeout, publishers})
                end || P <- Pubs],
        Made = lists:sum([M || {M, _} <- Done]),
        Samples = lists:append([S || {_, S} <- Done]),
        delivered(All, Made, Timeout),
        [exit(S, shutdown) || S <- All],
        Secs = DurMs / 1000,
        %% one sample per broadcast per subscribing node
        Bcasts = length(Samples) / Ackers,
        Sorted = lists:sort(Samples),
        #{bcast_s => Bcasts / Secs, deliveries_s => Bcasts * N * length(Sinks) / Secs,
          p50_us => percentile(50, Sorted), p99_us => percentile(99, Sorted)}
    after
        [H ! {stop, self()} || H <- Holders],
        [receive {stopped, H} -> ok after 5000 -> ok end || H <- Holders]
    end.

percentile(_P, []) -> 0;
percentile(P, Sorted) -> convoy_bench_stats:percentile(P, Sorted).

%% Every subscriber has seen a broadcast: the adapter's workers of B and C are
%% known to A (`pg' tells them asynchronously). `ready' goes out every 20 ms until
%% each subscriber has answered one.
ready(Subs, Timeout) ->
    Deadline = erlang:monotonic_time(millisecond) + Timeout,
    ready(Subs, 1, Deadline).

ready([], _I, _Deadline) ->
    ok;
ready(Waiting, I, Deadline) ->
    erlang:monotonic_time(millisecond) < Deadline orelse exit({timeout, subscribers_ready}),
    ok = ?PUBSUB:broadcast(?NAME, ?TOPIC, {convoy_bench_ready, self(), I}),
    Answered = collect_ready(I, erlang:monotonic_time(millisecond) + 20, []),
    ready(Waiting -- Answered, I + 1, Deadline).

collect_ready(I, Until, Acc) ->
    Left = max(0, Until - erlang:monotonic_time(millisecond)),
    receive
        {convoy_bench_ready, S, J} when J =< I -> collect_ready(I, Until, [S | Acc])
    after Left -> Acc
    end.

%% Every subscriber counted `Made' broadcasts (those still on their way are waited
%% for, up to `Timeout').
delivered(Subs, Made, Timeout) ->
    Deadline = erlang:monotonic_time(millisecond) + Timeout,
    [delivered_one(S, Made, Deadline) || S <- Subs],
    ok.

delivered_one(S, Made, Deadline) ->
    S ! {count, self()},
    receive
        {count, S, Made} ->
            ok;
        {count, S, Got} when Got < Made ->
            erlang:monotonic_time(millisecond) < Deadline
                orelse exit({lost, node(S), Made - Got, of_broadcasts, Made}),
            timer:sleep(10),
            delivered_one(S, Made, Deadline);
        {count, S, Got} ->
            exit({too_many, node(S), Got, Made})
    after max(1, Deadline - erlang:monotonic_time(millisecond)) ->
            exit({timeout, subscriber_count})
    end.

%% @doc On each node: Phoenix.PubSub `convoy_bench_pubsub' with `Adapter', started
%% by a holder process that stops it on `{stop, From}' (answering `{stopped,
%% Holder}') or when `Driver' goes (a measurement killed at its deadline).
-spec start_pubsub([file:filename()], module(), pid()) -> pid().
start_pubsub(Dirs, Adapter, Driver) ->
    ok = code:add_pathsz(Dirs),
    {ok, _} = application:ensure_all_started(phoenix_pubsub),
    Self = self(),
    Holder = spawn(fun() ->
                           process_flag(trap_exit, true),
                           Result = 'Elixir.Phoenix.PubSub.Supervisor':start_link(
                                      [{name, ?NAME}, {adapter, Adapter}]),
                           Self ! {started, self(), Result},
                           case Result of
                               {ok, Sup} -> hold(Sup, erlang:monitor(process, Driver));
                               _ -> ok
                           end
                   end),
    receive
        {started, Holder, {ok, _}} -> Holder;
        {started, Holder, Other} -> error({pubsub_start, node(), Other})
    end.

hold(Sup, DriverMon) ->
    receive
        {stop, From} ->
            stop_sup(Sup),
            From ! {stopped, self()};
        {'DOWN', DriverMon, process, _, _} ->
            stop_sup(Sup);
        {'EXIT', Sup, _} ->
            ok;
        _ ->
            hold(Sup, DriverMon)
    end.

stop_sup(Sup) ->
    Mon = erlang:monitor(process, Sup),
    exit(Sup, shutdown),
    receive {'DOWN', Mon, process, Sup, _} -> ok after 5000 -> exit(Sup, kill) end.

%% @doc On a subscribing node: `N' subscribers of the topic, each subscribed when
%% this returns; the first is the node's acker.
-spec subscribers(pos_integer(), pg2 | convoy | handover, pid(), pos_integer()) -> [pid()].
subscribers(N, Mode, Driver, Timeout) ->
    Self = self(),
    Pids = [spawn(?MODULE, subscriber, [Mode, I =:= 1, Driver, Self, 0]) || I <- lists:seq(1, N)],
    [receive {subscribed, P} -> ok after Timeout -> exit({timeout, subscribe}) end
     || P <- Pids],
    Pids.

%% @doc A subscriber: counts broadcasts; the acker also acknowledges each to its
%% publisher with the time it got it.
-spec subscriber(pg2 | convoy | handover, boolean(), pid(), pid() | none, non_neg_integer()) -> ok.
subscriber(Mode, Acker, Driver, Parent, 0) when is_pid(Parent) ->
    process_flag(message_queue_data, off_heap),
    erlang:monitor(process, Driver),
    ok = ?PUBSUB:subscribe(?NAME, ?TOPIC),
    Parent ! {subscribed, self()},
    subscriber(Mode, Acker, Driver, none, 0);
subscriber(Mode, Acker, Driver, none, Count) ->
    receive
        {convoy_bench_pub, From, Seq, _SentUs, _Event} when Acker ->
            ack(Mode, From, {convoy_bench_ack, Seq, os:system_time(microsecond)}),
            subscriber(Mode, Acker, Driver, none, Count + 1);
        {convoy_bench_pub, _From, _Seq, _SentUs, _Event} ->
            subscriber(Mode, Acker, Driver, none, Count + 1);
        {convoy_bench_ready, From, I} ->
            From ! {convoy_bench_ready, self(), I},
            subscriber(Mode, Acker, Driver, none, Count);
        {count, From} ->
            From ! {count, self(), Count},
            subscriber(Mode, Acker, Driver, none, Count);
        {'DOWN', _, process, Driver, _} ->
            ok
    end.

ack(pg2, To, Msg) -> erlang:send(To, Msg);
ack(convoy, To, Msg) -> convoy:send(To, Msg);
ack(handover, To, Msg) -> convoy_bench_handover:send(To, Msg).

%% @doc A publisher on the driver node: closed loop from `{go, Warm, Deadline}'
%% until the deadline; keeps, for the broadcasts made after the warm-up and
%% acknowledged before the deadline, each acker's latency (us); answers
%% `{pub_done, self(), Made, Samples}' (Made: every broadcast it made).
-spec publisher(pg2 | convoy | handover, pos_integer(), pid(), pos_integer(), pos_integer()) -> ok.
publisher(_Mode, Ackers, Driver, Id, Timeout) ->
    process_flag(message_queue_data, off_heap),
    receive
        {go, Warm, Deadline} ->
            publish_loop(Ackers, Driver, Id, Timeout, Warm, Deadline, 1, [])
    end.

publish_loop(Ackers, Driver, Id, Timeout, Warm, Deadline, Seq, Acc) ->
    T0 = erlang:monotonic_time(),
    case T0 >= Deadline of
        true ->
            Driver ! {pub_done, self(), Seq - 1, Acc},
            ok;
        false ->
            SentUs = os:system_time(microsecond),
            Event = {event, Seq, <<"user-42">>, #{k => Seq, publisher => Id}},
            ok = ?PUBSUB:broadcast(?NAME, ?TOPIC, {convoy_bench_pub, self(), Seq, SentUs, Event}),
            Lat = [receive
                       {convoy_bench_ack, Seq, AtUs} -> AtUs - SentUs
                   after Timeout -> exit({timeout, ack, Seq})
                   end || _ <- lists:seq(1, Ackers)],
            T1 = erlang:monotonic_time(),
            Acc1 = case T0 >= Warm andalso T1 =< Deadline of
                       true -> Lat ++ Acc;
                       false -> Acc
                   end,
            publish_loop(Ackers, Driver, Id, Timeout, Warm, Deadline, Seq + 1, Acc1)
    end.
