%% @private
%% A lane's meter under `compress => auto': the process the peer's inbox answers
%% the meter of each batch of a busy run (`convoy_wire:meter/2'). The lane
%% cannot take the answers in time itself: it waits on its node's connection
%% with its senders' backlog in its mailbox, ahead of any answer, so a level
%% decided from them would come a whole backlog late. The meter keeps the
%% node's measures (`convoy_compress_auto') and writes the level they give in a
%% table the lane reads as it builds each busy batch (`level/1'); it reports a
%% change of the mode chosen (`[convoy, node, compress]'). It is linked to its
%% lane and ends with it.
-module(convoy_meter).

-export([start_link/4, pid/1, level/1, summary/1, stop/1]).

-export_type([meter/0]).

-record(meter, {pid :: pid(), table :: ets:tid()}).
-opaque meter() :: #meter{}.

%% @doc A meter of the calling lane's busy batches to `Node' (lane `Index'),
%% taking the answers tagged `Secret'; events if `Telemetry'. Starts at `never'
%% (plain), as a node measured for the first time does.
-spec start_link(node(), pos_integer(), reference(), boolean()) -> meter().
start_link(Node, Index, Secret, Telemetry) ->
    Table = ets:new(?MODULE, [set, public, {read_concurrency, true}]),
    true = ets:insert(Table, [{level, never}, {summary, #{}}]),
    {_, Meters} = convoy_compress_auto:level(Node, convoy_compress_auto:new()),
    Pid = spawn_link(fun() -> loop({Node, Index, Secret, Telemetry, Table}, Meters) end),
    #meter{pid = Pid, table = Table}.

%% @doc The meter's process.
-spec pid(meter()) -> pid().
pid(#meter{pid = Pid}) -> Pid.

%% @doc The pid the answers go to, and the level the next busy batch is
%% compressed at (`never': plain).
-spec level(meter()) -> {pid(), never | 1..9}.
level(#meter{pid = Pid, table = Table}) ->
    {Pid, ets:lookup_element(Table, level, 2)}.

%% @doc Each measured node's mode and the answers taken (the lane's
%% `sys:get_state/1').
-spec summary(meter() | none) -> map().
summary(none) -> #{};
summary(#meter{table = Table}) -> ets:lookup_element(Table, summary, 2).

%% @doc The meter goes (its node is gone: what it measured no longer holds).
-spec stop(meter()) -> ok.
stop(#meter{pid = Pid, table = Table}) ->
    Mon = erlang:monitor(process, Pid),
    true = unlink(Pid),
    true = exit(Pid, kill),
    receive {'DOWN', Mon, process, Pid, _} -> ok end,
    true = ets:delete(Table),
    ok.

loop(St = {Node, Index, Secret, Telemetry, Table}, Meters) ->
    receive
        {{Secret, Node, Tag}, convoy_meter, Time} when is_integer(Time) ->
            {Meters1, Change} = convoy_compress_auto:answered(Node, Tag, Time, Meters),
            _ = case Change of
                    none ->
                        ok;
                    {level, Level} ->
                        ets:insert(Table, {level, Level});
                    {chosen, Mode, Level, Rates} ->
                        true = ets:insert(Table, {level, Level}),
                        convoy_metrics:emit(Telemetry, [convoy, node, compress], Rates,
                                            #{node => Node, lane => Index, mode => Mode})
                end,
            true = ets:insert(Table, {summary, convoy_compress_auto:summary(Meters1)}),
            loop(St, Meters1);
        _Stray ->
            convoy_metrics:rejected(unknown_message),
            loop(St, Meters)
    end.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

%% Answers in a row of one busy run, each lot of 1,000 messages taking `Us'
%% microseconds at the peer: the meter measures plain, tries zip, and the level
%% the lane reads follows; an answer without the secret is counted and changes
%% nothing.
follows_its_answers_test() ->
    _ = persistent_term:get({convoy, rejected}, undefined) =:= undefined
        andalso convoy_metrics:init(),
    Stray0 = maps:get(unknown_message, convoy_metrics:rejected()),
    Secret = make_ref(),
    M = start_link(n@h, 1, Secret, false),
    {Pid, never} = level(M),
    Run = make_ref(),
    Answer = fun(Seq, Mode, At) ->
                     Pid ! {{Secret, n@h, {Run, Seq, Mode, 1000}}, convoy_meter, At}
             end,
    %% plain, 5 ms a lot: measured (a first measure thrown away, then one kept),
    %% then zip is tried at once
    _ = [Answer(Seq, plain, Seq * 5000) || Seq <- lists:seq(1, 40)],
    Pid ! {{make_ref(), n@h, {Run, 41, plain, 1000}}, convoy_meter, 41 * 5000},
    ok = await(fun() -> level(M) =:= {Pid, 1} end),
    ?assertMatch(#{n@h := #{mode := zip, answers := 40}}, summary(M)),
    ok = await(fun() -> maps:get(unknown_message, convoy_metrics:rejected()) =:= Stray0 + 1 end),
    ok = stop(M),
    ?assertNot(is_process_alive(Pid)).

await(Fun) -> await(Fun, 100).
await(_Fun, 0) -> timeout;
await(Fun, N) ->
    case Fun() of
        true -> ok;
        false -> receive after 10 -> await(Fun, N - 1) end
    end.

-endif.
